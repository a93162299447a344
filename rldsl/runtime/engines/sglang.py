"""SGLang engines: ``SGLangGenerator`` (generation) and ``SGLangLogprob``
(response log-probabilities), over SGLang's offline ``sglang.Engine`` inside
the stage's actor.

SGLang is imported only when an engine is built, so this module imports
without it. Everything that does not need SGLang itself (building requests,
turning SGLang's output dicts into a batch, the weight-sync bookkeeping) is
plain code over the dicts and methods of ``sglang.Engine`` and is tested
without SGLang.

- One actor drives a whole tensor-parallel group (``tp`` GPUs): the engine
  starts one scheduler process per GPU the actor can see (``tp_size``).
- Requests are token ids (``input_ids``; the engine starts without its
  tokenizer): one request per sample, each with its own ``sampling_seed``,
  so a batch does not depend on what SGLang schedules together; SGLang
  honours the seed only with ``deterministic`` (its deterministic-inference
  mode), otherwise each sample is a fresh draw.
- Behaviour logprobs come from ``return_logprob = True``:
  ``meta_info["output_token_logprobs"]`` holds ``(logprob, token_id, text)``
  per generated token. ``SGLANG_RETURN_ORIGINAL_LOGPROB = 1`` makes them the
  log-probabilities before temperature and top-p, the quantity the trainer
  recomputes (``torch_generate`` defines it the same way).
- Weight sync: buckets of Hugging Face-named tensors are staged in this
  process's host memory; with the last bucket all of them go to the engine
  in one ``update_weights_from_tensor`` call (SGLang's model loaders shard
  them for tensor parallelism and fuse q/k/v and gate/up), which also
  flushes the prefix cache, and the version changes. A layer split by a
  bucket boundary is thus never half updated, and the engine never restarts.
- Colocated placement: ``enable_memory_saver`` lets ``sleep`` release the GPU
  (``release_memory_occupation``) and ``wake`` take it back. Level 1 keeps a
  host copy of the weights (``enable_weights_cpu_backup``); level 2 drops
  them: use it only when a full weight sync follows every wake.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rldsl.runtime.engines.serving import (
    TORCH_DTYPE_NAMES,
    ServingEngine,
    ServingGeneration,
    bucket_items,
    encode_or_error,
    load_tokenizer,
    prompt_token_ids,
    request_seeds,
    sampled_batch,
    scoring_rows,
)
from rldsl.runtime.engines.torch.common import decode_responses
from rldsl.runtime.protocols import (
    FIELD_RESPONSE_IDS,
    Batch,
    Prompt,
)

INSTALL_HINT = "the sglang engine needs SGLang on a GPU machine: pip install 'sglang[all]' (see docs/engines.md)"


# -- requests -------------------------------------------------------------------------


def sampling_params(max_new_tokens: int, temperature: float, top_p: float, seed: int | None, top_k: int = 0,
                    stop_token_ids: Sequence[int] = (), min_new_tokens: int = 0) -> dict[str, Any]:
    """SGLang's sampling-parameter dict for one sample (``n`` stays 1: each
    sample is its own request with its own seed; ``top_k`` 0 is SGLang's -1)."""
    params = {"max_new_tokens": max_new_tokens, "min_new_tokens": min_new_tokens, "temperature": temperature,
              "top_p": top_p, "top_k": top_k or -1, "n": 1}
    if stop_token_ids:
        params["stop_token_ids"] = list(stop_token_ids)
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def sample_seeds(seed: int, prompts: int, samples_per_prompt: int) -> list[list[int]]:
    """Per prompt, one seed per sample: the batch's rows numbered from ``seed``
    (distinct within a batch, and small enough for any integer seed type)."""
    rows = request_seeds(seed, prompts * samples_per_prompt)
    return [rows[index * samples_per_prompt:(index + 1) * samples_per_prompt] for index in range(prompts)]


def expanded_requests(prompt_ids: Sequence[Sequence[int]], samples_per_prompt: int, seed: int, max_new_tokens: int,
                      temperature: float, top_p: float, top_k: int = 0, stop_token_ids: Sequence[int] = (),
                      min_new_tokens: int = 0) -> tuple[list[list[int]], list[dict]]:
    """``input_ids`` and ``sampling_params`` lists, prompt-major: every prompt
    repeated ``samples_per_prompt`` times, each sample with its own seed."""
    inputs, params = [], []
    for ids, seeds in zip(prompt_ids, sample_seeds(seed, len(prompt_ids), samples_per_prompt)):
        for sample_seed in seeds:
            inputs.append(list(ids))
            params.append(sampling_params(max_new_tokens, temperature, top_p, sample_seed, top_k, stop_token_ids,
                                          min_new_tokens))
    return inputs, params



# -- outputs -> batch ------------------------------------------------------------------


def sampled_tokens_and_logprobs(output: Mapping[str, Any]) -> tuple[list[int], list[float]]:
    """The generated tokens of one SGLang output dict and the log-probability
    of each, from ``meta_info["output_token_logprobs"]``."""
    entries = output.get("meta_info", {}).get("output_token_logprobs")
    if entries is None:
        raise RuntimeError("SGLang returned no output_token_logprobs; the request must set return_logprob = True")
    tokens = [int(token) for _, token, _ in entries]
    logprobs = [float(value) for value, _, _ in entries]
    output_ids = output.get("output_ids")
    if output_ids is not None and list(output_ids) != tokens:  # the two views of one response must agree
        raise RuntimeError(f"SGLang output_ids {list(output_ids)} differ from its logprob tokens {tokens}")
    return tokens, logprobs


def batch_from_outputs(prompt_ids: Sequence[Sequence[int]], outputs: Sequence[Mapping[str, Any]],
                       samples_per_prompt: int, version: int) -> Batch:
    """SGLang output dicts (one per sample, prompt-major) -> a batch with
    behaviour logprobs aligned to the response tokens and the version on
    every row. A response ending in EOS keeps it, inside the mask."""
    if len(outputs) != len(prompt_ids) * samples_per_prompt:
        raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {len(prompt_ids)} prompts x "
                           f"{samples_per_prompt} samples")
    prompts = [list(ids) for ids in prompt_ids for _ in range(samples_per_prompt)]
    responses, logprobs = zip(*(sampled_tokens_and_logprobs(output) for output in outputs))
    return sampled_batch(prompts, responses, logprobs, version)


# -- the engines -------------------------------------------------------------------------


@dataclass(frozen=True)
class SGLangOptions:
    """The ``sglang(...)`` engine arguments of a stage."""

    tp: int = 1
    gpu_memory: float = 0.9
    sleep: bool | int = True  # the plan's level: 0 (never), 1 (weights kept in host memory), 2 (weights dropped)
    max_model_len: int | None = None
    dtype: str = "bf16"
    sleep_level: int = 1  # the level for `sleep = True`
    # SGLang honours a request's ``sampling_seed`` only in its deterministic-inference mode
    # (batch-invariant kernels, slower); without it, samples are fresh draws that no seed reproduces
    deterministic: bool = False

    @property
    def level(self) -> int:
        return self.sleep_level if self.sleep is True else int(self.sleep)

    def engine_kwargs(self, model_path: str, seed: int) -> dict[str, Any]:
        """``sglang.Engine`` (``ServerArgs``) keyword arguments."""
        kwargs = {
            "model_path": model_path,
            "tokenizer_path": model_path,
            "skip_tokenizer_init": True,  # requests and outputs are token ids
            "tp_size": self.tp,
            "mem_fraction_static": self.gpu_memory,
            "dtype": TORCH_DTYPE_NAMES[self.dtype],
            "random_seed": seed,
            "enable_memory_saver": self.level > 0,
            "log_level": "error",
        }
        if self.level > 0:
            kwargs["enable_weights_cpu_backup"] = self.level == 1
        if self.max_model_len:
            kwargs["context_length"] = self.max_model_len
        if self.deterministic:
            kwargs["enable_deterministic_inference"] = True
        return kwargs


def create_engine(model_path: str, options: SGLangOptions, seed: int):
    """SGLang's offline engine (imported here: only GPU machines have it)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")  # logprobs before temperature, as trained
    try:
        import sglang
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return sglang.Engine(**options.engine_kwargs(model_path, seed))


class _SGLangEngine(ServingEngine):
    """What generation and logprob engines share: the engine, weight sync, sleep."""

    NAME = "SGLang"

    def __init__(self, engine, tokenizer, options: SGLangOptions):
        super().__init__(tokenizer)
        self.engine = engine
        self.options = options
        self._staged: list[tuple[str, torch.Tensor]] = []

    def update_weights(self, bucket: Mapping[str, Any], version: int, last: bool) -> None:
        """Stage the bucket; with the last one load all staged tensors in one
        call, so no request ever runs on half-updated weights."""
        self._require_awake("update_weights")
        self._sync.check_accepts(version)
        self._staged.extend(bucket_items(bucket))
        if last:
            staged, self._staged = self._staged, []
            result = self.engine.update_weights_from_tensor(named_tensors=staged, flush_cache=True)
            _require_success(result, "update_weights_from_tensor")
        self._sync.receive(version, last)

    def _sleeps(self) -> bool:
        return bool(self.options.level)

    def _release_memory(self) -> None:
        self.engine.release_memory_occupation()

    def _resume_memory(self) -> None:
        self.engine.resume_memory_occupation()

    def _generate(self, input_ids: list[list[int]], params: list[dict], **options) -> list[dict]:
        if not input_ids:
            return []
        outputs = self.engine.generate(input_ids=input_ids, sampling_params=params, return_logprob=True, **options)
        return [outputs] if isinstance(outputs, dict) else list(outputs)  # one request comes back unwrapped


def _require_success(result: Any, what: str) -> None:
    """SGLang's weight calls answer ``(success, message)``."""
    if isinstance(result, tuple) and len(result) == 2 and result[0] is False:
        raise RuntimeError(f"SGLang {what} failed: {result[1]}")


class SGLangGenerator(ServingGeneration, _SGLangEngine):
    """``protocols.GenerationEngine`` over SGLang (each sample its own request and seed)."""

    @property
    def context_limit(self) -> int | None:
        return self.options.max_model_len

    def __init__(self, engine, tokenizer, options: SGLangOptions = SGLangOptions(), *, max_new_tokens: int = 64,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop_token_ids: Sequence[int] = (),
                 min_new_tokens: int = 0):
        self._set_sampling(max_new_tokens, temperature, top_p, top_k, stop_token_ids, min_new_tokens)
        super().__init__(engine, tokenizer, options)

    @classmethod
    def from_path(cls, model_path: str, options: SGLangOptions = SGLangOptions(), seed: int = 0, **sampling):
        return cls(create_engine(model_path, options, seed), load_tokenizer(model_path), options, **sampling)

    def generate_groups(self, requests: Sequence[tuple[Sequence[Prompt], int, int]]) -> list[Batch | ValueError]:
        """One batch per ``(prompts, samples_per_prompt, seed)`` request, all
        submitted in ONE ``Engine.generate`` call (SGLang batches them
        continuously) and split back per request. A request whose prompts
        cannot be encoded comes back as its ``ValueError``; the others run."""
        self._require_ready()
        encoded = [encode_or_error(self.tokenizer, prompts) for prompts, _, _ in requests]
        inputs, params = [], []
        for ids, (_, n, seed) in zip(encoded, requests):
            if not isinstance(ids, ValueError):
                request_inputs, request_params = expanded_requests(ids, n, seed, self.max_new_tokens,
                                                                   self.temperature, self.top_p, self.top_k,
                                                                   self.stop_token_ids, self.min_new_tokens)
                inputs += request_inputs
                params += request_params
        outputs = iter(self._generate(inputs, params))
        return [ids if isinstance(ids, ValueError)  # batch_from_outputs checks each request got its outputs
                else batch_from_outputs(ids, list(itertools.islice(outputs, len(ids) * n)), n, self.version)
                for ids, (_, n, _) in zip(encoded, requests)]

    def generate_greedy(self, prompts: list[Prompt]) -> list[str]:
        """One argmax response per prompt (temperature 0), for evaluation."""
        self._require_ready()
        ids = prompt_token_ids(self.tokenizer, prompts)
        params = [sampling_params(self.max_new_tokens, 0.0, 1.0, None, stop_token_ids=self.stop_token_ids)
                  for _ in ids]
        outputs = self._generate([list(row) for row in ids], params)
        return decode_responses(self.tokenizer, batch_from_outputs(ids, outputs, 1, self.version))


# -- log-probabilities of given responses ------------------------------------------------


def logprobs_from_input_logprobs(prompt_lengths: Sequence[int], response_lengths: Sequence[int],
                                 outputs: Sequence[Mapping[str, Any]], width: int) -> torch.Tensor:
    """``meta_info["input_token_logprobs"]`` (one ``(logprob, token_id, text)``
    per input position from ``logprob_start_len = 0``, None at position 0)
    -> float32 [n, width] log-probabilities of the response tokens, 0 elsewhere."""
    result = torch.zeros(len(prompt_lengths), width, dtype=torch.float32)
    for row, (start, length, output) in enumerate(zip(prompt_lengths, response_lengths, outputs)):
        per_position = output["meta_info"]["input_token_logprobs"]
        for j in range(length):
            result[row, j] = float(per_position[start + j][0])
    return result


class SGLangLogprob(_SGLangEngine):
    """``protocols.LogprobEngine`` over SGLang: each row is scored as a
    prompt (input logprobs from position 0) with one throwaway new token."""

    @classmethod
    def from_path(cls, model_path: str, options: SGLangOptions = SGLangOptions(), seed: int = 0):
        return cls(create_engine(model_path, options, seed), load_tokenizer(model_path), options)

    def logprobs(self, batch: Batch) -> torch.Tensor:
        self._require_ready()
        rows, starts, lengths = scoring_rows(batch)
        params = [sampling_params(1, 1.0, 1.0, None) for _ in rows]
        outputs = self._generate([list(row) for row in rows], params, logprob_start_len=0)
        return logprobs_from_input_logprobs(starts, lengths, outputs, batch[FIELD_RESPONSE_IDS].shape[1])
