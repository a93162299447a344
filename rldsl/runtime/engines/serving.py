"""What the serving engines (vLLM, SGLang) share: requests as token ids,
batches from their outputs, weight buckets and the version they carry.
Nothing here imports either library."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Callable

import torch

from rldsl.runtime.engines.torch.common import decode_responses, left_align
from rldsl.runtime.protocols import (
    FIELD_BEHAVIOUR_LOGPROBS,
    FIELD_PROMPT_IDS,
    FIELD_PROMPT_MASK,
    FIELD_RESPONSE_IDS,
    FIELD_RESPONSE_MASK,
    FIELD_TOKEN_VERSIONS,
    FIELD_VERSION,
    Batch,
    Prompt,
)

TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # the language's -> the engines'


def prompt_token_ids(tokenizer, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Each prompt's tokens (``Prompt.tokens``), as the torch engines read them."""
    ids = [prompt.tokens(tokenizer) for prompt in prompts]
    if any(not row for row in ids):
        raise ValueError("a prompt encodes to no tokens; the model needs at least one to condition on")
    return ids


def encode_or_error(tokenizer, prompts: Sequence[Prompt]) -> list[list[int]] | ValueError:
    """``prompt_token_ids``, or the error, so one bad group fails alone in a batched call."""
    try:
        return prompt_token_ids(tokenizer, prompts)
    except ValueError as error:
        return error


def request_seeds(seed: int, count: int) -> list[int]:
    """One seed per prompt: the batch is reproducible whatever vLLM schedules together."""
    return [seed * 1_000_003 + index for index in range(count)]


def left_padded(rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        if row:
            ids[index, width - len(row):] = torch.tensor(row)
            mask[index, width - len(row):] = 1
    return ids, mask


def bucket_items(bucket: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """A bucket as the ``(name, tensor)`` list vLLM's ``load_weights`` takes."""
    items = []
    for name, tensor in bucket.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            kinds = f"{type(name).__name__} -> {type(tensor).__name__}"
            raise TypeError(f"a weight bucket maps names to tensors; got {kinds}")
        items.append((name, tensor.detach().cpu().contiguous()))
    return items


class WeightSync:
    """Which version the weights are, and whether a sync is half applied."""

    def __init__(self, version: int = 0):
        self.version = version
        self.pending: int | None = None

    def check_accepts(self, version: int) -> None:
        if self.pending not in (None, version):
            raise RuntimeError(
                f"weight bucket for version {version} arrived while version {self.pending} was half applied; "
                "a sync must finish (last=True) before the next begins")

    def receive(self, version: int, last: bool) -> None:
        self.check_accepts(version)
        self.pending = None if last else version
        if last:
            self.version = version

    def require_consistent(self) -> None:
        if self.pending is not None:
            raise RuntimeError(f"weight sync to version {self.pending} is in progress (last bucket not received)")


def sampled_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                  logprobs: Sequence[Sequence[float]], version: int | Sequence[int],
                  token_versions: Sequence[Sequence[int]] | None = None) -> Batch:
    """One row per sample (its prompt's ids, its response and the log-probability
    of each sampled token) -> a batch: prompts left-padded, responses and
    behaviour logprobs right-padded (0 off the mask), the version on every row
    (one for all, or each row's), and with ``token_versions`` each token's
    (``FIELD_TOKEN_VERSIONS``, right-padded with the row's last)."""
    prompt_tensor, prompt_mask = left_padded(prompts)
    width = max([1] + [len(row) for row in responses])
    response_ids = torch.zeros(len(responses), width, dtype=torch.long)
    response_mask = torch.zeros(len(responses), width, dtype=torch.long)
    behaviour = torch.zeros(len(responses), width, dtype=torch.float32)
    for row, (tokens, values) in enumerate(zip(responses, logprobs)):
        response_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        response_mask[row, : len(tokens)] = 1
        behaviour[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    versions = [version] * len(responses) if isinstance(version, int) else list(version)
    batch = {
        FIELD_PROMPT_IDS: prompt_tensor,
        FIELD_PROMPT_MASK: prompt_mask,
        FIELD_RESPONSE_IDS: response_ids,
        FIELD_RESPONSE_MASK: response_mask,
        FIELD_BEHAVIOUR_LOGPROBS: behaviour,
        FIELD_VERSION: torch.tensor(versions, dtype=torch.long),
    }
    if token_versions is not None:
        per_token = torch.tensor(versions, dtype=torch.long)[:, None].repeat(1, width)
        for row, values in enumerate(token_versions):
            if values:
                per_token[row, : len(values)] = torch.tensor(values, dtype=torch.long)
                per_token[row, len(values):] = values[-1]
        batch[FIELD_TOKEN_VERSIONS] = per_token
    return batch


class ServingEngine:
    """What the generation and logprob sides of a serving engine share: the
    weight version and a sync in progress, sleeping, and the check that it
    may compute. A subclass names itself and releases / resumes memory."""

    NAME = "serving"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._sync = WeightSync()
        self._asleep = False

    @property
    def version(self) -> int:
        return self._sync.version

    @version.setter
    def version(self, value: int) -> None:
        self._sync.version = value

    def sleep(self) -> None:
        if self._sleeps() and not self._asleep:
            self._release_memory()
            self._asleep = True

    def wake(self) -> None:
        if self._asleep:
            self._resume_memory()
            self._asleep = False

    def _sleeps(self) -> bool:
        raise NotImplementedError

    def _release_memory(self) -> None:
        raise NotImplementedError

    def _resume_memory(self) -> None:
        raise NotImplementedError

    def _require_awake(self, call: str) -> None:
        if self._asleep:
            raise RuntimeError(f"{call} on a sleeping {self.NAME} engine; wake it first")

    def _require_ready(self) -> None:
        if self._asleep:
            raise RuntimeError(f"the {self.NAME} engine is asleep; call wake() first")
        self._sync.require_consistent()


class ServingGeneration:
    """The generation side's sampling settings, single-request ``generate``
    and ``decode`` over the subclass's ``generate_groups``."""

    def _set_sampling(self, max_new_tokens: int, temperature: float, top_p: float, top_k: int = 0,
                      stop_token_ids: Sequence[int] = (), min_new_tokens: int = 0) -> None:
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or not 0 <= min_new_tokens <= max_new_tokens:
            raise ValueError("temperature must be >= 0, top_p in (0, 1], top_k >= 0 and min_new_tokens in "
                             "[0, max_new_tokens]")
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.top_k, self.stop_token_ids, self.min_new_tokens = top_k, tuple(stop_token_ids), min_new_tokens

    def generate(self, prompts: list[Prompt], samples_per_prompt: int, seed: int) -> Batch:
        """Rows prompt-major; each prompt's samples are seeded from ``seed``."""
        (batch,) = self.generate_groups([(prompts, samples_per_prompt, seed)])
        if isinstance(batch, ValueError):
            raise batch
        return batch

    def decode(self, batch: Batch) -> list[str]:
        return decode_responses(self.tokenizer, batch)


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    from rldsl.models.hf import HFTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(model_path, local_files_only=True))


def scoring_rows(batch: Batch) -> tuple[list[list[int]], list[int], list[int]]:
    """Per row: real prompt + real response tokens, the prompt length and the
    response length (the response mask is a prefix of the row)."""
    prompt_ids, prompt_mask = left_align(batch[FIELD_PROMPT_IDS], batch[FIELD_PROMPT_MASK])
    rows, prompt_lengths, response_lengths = [], [], []
    for ids, mask, response, response_mask in zip(prompt_ids, prompt_mask, batch[FIELD_RESPONSE_IDS],
                                                  batch[FIELD_RESPONSE_MASK]):
        prompt = ids[mask.bool()].tolist()
        length = int(response_mask.sum())
        rows.append(prompt + response[:length].tolist())
        prompt_lengths.append(len(prompt))
        response_lengths.append(length)
    return rows, prompt_lengths, response_lengths


class EventLoopThread:
    """An asyncio loop on a daemon thread of its own, for an engine's async
    API: ``submit`` schedules a coroutine there and returns its
    ``concurrent.futures.Future`` (the batcher's thread never blocks on it),
    ``run`` waits for one (weight updates, sleep: called between requests)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine) -> Any:
        return self.submit(coroutine).result()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loop and its thread (a daemon thread still running native
        code while the interpreter finalises can crash it)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


def then(future: Future, convert: Callable[[Any], Any]) -> Future:
    """A future holding ``convert(result)`` of ``future``, or its error."""
    converted: Future = Future()

    def finish(done: Future) -> None:
        try:
            converted.set_result(convert(done.result()))
        except BaseException as error:
            converted.set_exception(error)

    future.add_done_callback(finish)
    return converted


def failed(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future
