"""vLLM engines: ``VLLMGenerator`` (generation) and ``VLLMLogprob`` (response
log-probabilities), over vLLM's offline ``LLM`` inside the stage's actor.

vLLM is imported only when an engine is built, so this module imports
without it. Everything that does not need vLLM itself (building requests,
turning outputs into a batch, the weight-sync bookkeeping) is plain code
over duck-typed vLLM objects and is tested without vLLM.

- One actor drives a whole replica (``tp`` x ``pp`` GPUs): vLLM's
  multiprocessing executor starts one worker per GPU the actor can see. A
  replica whose pipeline stages span nodes (``pp`` > 1) runs on vLLM's Ray
  executor instead, which places a worker on each node's GPUs.
- Behaviour logprobs are vLLM's ``raw_logprobs``: the log-probability of the
  sampled token under the model's own distribution at temperature 1 before
  top-p, the quantity the trainer recomputes (``torch_generate`` defines it
  the same way).
- Weight sync: each bucket of Hugging Face-named tensors goes to every vLLM
  worker through ``collective_rpc`` and is staged there; with the last
  bucket the workers reload them in place through vLLM (which shards for
  tensor parallelism, fuses q/k/v and gate/up, and redoes any kernel
  repacking), the prefix cache (KV computed under the old weights) is
  dropped and the version changes. The engine is never restarted, and no
  request ever sees a mix of old and new weights.
- Colocated placement: ``enable_sleep_mode`` lets ``sleep`` release the GPU
  (level 1 keeps the weights in host memory, level 2 drops them: use it only
  when a full weight sync follows every wake) and ``wake`` take it back.
- Streaming: a generator built ``from_path`` runs on vLLM's ``AsyncLLM``
  (``vllm_async.AsyncLLMBridge``, its own event-loop thread): ``start_group`` submits a
  group's prompts the moment the batcher admits it and its future completes
  when that group's last sequence ends, so groups finish independently. A
  generator over the offline ``LLM`` serves whole-batch waves
  (``generate_groups``).
"""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from rldsl.runtime.engines.serving import (
    TORCH_DTYPE_NAMES,
    EventLoopThread,
    ServingEngine,
    ServingGeneration,
    bucket_items,
    encode_or_error,
    load_tokenizer,
    prompt_token_ids,
    request_seeds,
    sampled_batch,
    scoring_rows,
    then,
)
from rldsl.runtime.engines.vllm_async import AsyncLLMBridge
from rldsl.runtime.engines.torch.common import decode_responses
from rldsl.runtime.protocols import (
    FIELD_RESPONSE_IDS,
    Batch,
    Prompt,
)

STAGE_WEIGHTS_RPC = "rldsl_stage_weights"
APPLY_WEIGHTS_RPC = "rldsl_apply_weights"
INSTALL_HINT = "the vllm engine needs vLLM on a GPU machine: pip install 'rldsl[gpu]' (see docs/engines.md)"


# -- requests -------------------------------------------------------------------------


def sampling_options(samples_per_prompt: int, max_new_tokens: int, temperature: float, top_p: float,
                     seed: int | None, top_k: int = 0, stop_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    """``SamplingParams`` arguments for one prompt: ``n`` samples, and the
    log-probability of each sampled token (``logprobs = 0``: none besides it).
    ``top_k`` 0 is vLLM's -1 (every token)."""
    return {"n": samples_per_prompt, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
            "top_k": top_k or -1, "stop_token_ids": list(stop_token_ids), "seed": seed, "logprobs": 0,
            "detokenize": False}



# -- outputs -> batch ------------------------------------------------------------------


def sampled_logprobs(completion) -> list[float]:
    """The log-probability of each sampled token of one vLLM completion."""
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no logprobs; the request must set logprobs = 0")
    return [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]


def batch_from_outputs(prompt_ids: Sequence[Sequence[int]], outputs: Sequence[Any], samples_per_prompt: int,
                       version: int) -> Batch:
    """vLLM ``RequestOutput``s (one per prompt, ``n`` completions each) -> a
    prompt-major batch with behaviour logprobs and the version on every row."""
    if len(outputs) != len(prompt_ids):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompt_ids)} prompts")
    prompts, responses, logprobs = [], [], []
    for ids, output in zip(prompt_ids, outputs):
        if len(output.outputs) != samples_per_prompt:
            raise RuntimeError(f"vLLM returned {len(output.outputs)} samples, expected {samples_per_prompt}")
        for completion in output.outputs:
            prompts.append(list(ids))
            responses.append(list(completion.token_ids))
            logprobs.append(sampled_logprobs(completion))
    return sampled_batch(prompts, responses, logprobs, version)


# -- weight sync ------------------------------------------------------------------------


def pack_bucket(items: list[tuple[str, torch.Tensor]]) -> bytes:
    """Serialise a bucket for ``collective_rpc``. vLLM's RPC encoder does not
    keep tensors nested in lists as tensors, so they travel as one
    ``torch.save`` payload (exact, any dtype including bf16)."""
    buffer = io.BytesIO()
    torch.save(items, buffer)
    return buffer.getvalue()


def unpack_bucket(payload: bytes) -> list[tuple[str, torch.Tensor]]:
    return torch.load(io.BytesIO(payload), weights_only=True)


def ties_word_embeddings(worker) -> bool:
    config = getattr(getattr(worker.model_runner, "model_config", None), "hf_config", None)
    return bool(getattr(config, "tie_word_embeddings", False))


def with_tied_output_layer(items: list[tuple[str, torch.Tensor]], tied: bool) -> list[tuple[str, torch.Tensor]]:
    """Add ``lm_head.weight`` = the embedding when a tied model's sync lacks it
    (the megatron export sends the shared tensor once): vLLM's in-place
    reload restores the OLD weight of a layer that receives nothing, which
    would untie the output layer from the new embedding."""
    names = dict(items)
    if tied and "lm_head.weight" not in names and "model.embed_tokens.weight" in names:
        return [*items, ("lm_head.weight", names["model.embed_tokens.weight"])]
    return items


class VLLMWeightLoader:
    """Mixed into every vLLM worker (``worker_extension_cls``); ``collective_rpc``
    calls its methods by name inside the workers.

    Buckets are staged in the worker's host memory and applied together with
    the last one: vLLM's in-place ``reload_weights`` re-runs the per-layer
    post-processing (kernel repacking on some backends), which needs all of
    a layer's weights at once, and a bucket boundary can split a layer.
    """

    def rldsl_stage_weights(self, payload: bytes) -> int:
        staged = self.__dict__.setdefault("_rldsl_staged", [])
        staged.extend(unpack_bucket(payload))
        return len(staged)

    def rldsl_apply_weights(self) -> int:
        items = with_tied_output_layer(self.__dict__.pop("_rldsl_staged", []), ties_word_embeddings(self))
        if hasattr(self, "reload_weights"):  # vLLM's in-place reload (recent versions)
            self.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
        else:
            self.model_runner.model.load_weights(weights=items)
        return len(items)


# -- the engines -------------------------------------------------------------------------


@dataclass(frozen=True)
class VLLMOptions:
    """The ``vllm(...)`` engine arguments of a stage."""

    tp: int = 1
    pp: int = 1
    spans_nodes: bool = False  # the replica's GPUs are on more than one node (only with pp > 1)
    gpu_memory: float = 0.9
    sleep: bool | int = True  # the plan's level: 0 (never), 1 (weights to host memory), 2 (weights discarded)
    max_model_len: int | None = None
    dtype: str = "bf16"
    sleep_level: int = 1  # the level for `sleep = True`
    enforce_eager: bool = False

    @property
    def level(self) -> int:
        """vLLM's sleep level: `sleep` when it names one, else `sleep_level`."""
        return self.sleep_level if self.sleep is True else int(self.sleep)

    def llm_kwargs(self, model_path: str, seed: int) -> dict[str, Any]:
        kwargs = {
            "model": model_path,
            "tokenizer": model_path,
            "tensor_parallel_size": self.tp,
            "pipeline_parallel_size": self.pp,
            "gpu_memory_utilization": self.gpu_memory,
            "enable_sleep_mode": bool(self.sleep),
            "dtype": TORCH_DTYPE_NAMES[self.dtype],
            "seed": seed,
            "logprobs_mode": "raw_logprobs",
            "worker_extension_cls": f"{__name__}.{VLLMWeightLoader.__name__}",
            "enforce_eager": self.enforce_eager,
        }
        if self.max_model_len:
            kwargs["max_model_len"] = self.max_model_len
        backend = self.executor_backend()
        if backend:
            kwargs["distributed_executor_backend"] = backend
        return kwargs

    def executor_backend(self) -> str | None:
        """None for one GPU; "mp" when this actor sees every GPU of the
        replica; "ray" when the replica spans nodes, which one process's
        workers cannot reach."""
        if self.spans_nodes:
            return "ray"
        return "mp" if self.tp * self.pp > 1 else None


def create_llm(model_path: str, options: VLLMOptions, seed: int):
    """vLLM's offline engine (imported here: only GPU machines have it)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # workers must not fork a CUDA parent
    if options.spans_nodes:
        _share_ray_address()
    try:
        import vllm
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return vllm.LLM(**options.llm_kwargs(model_path, seed))


def create_async_llm(model_path: str, options: VLLMOptions, seed: int) -> AsyncLLMBridge:
    """vLLM's ``AsyncLLM`` with the offline engine's arguments, on a loop thread of its own."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if options.spans_nodes:
        _share_ray_address()
    try:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    loop = EventLoopThread("vllm-async")

    async def build():  # inside the loop: AsyncLLM's output handler binds to the running loop
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**options.llm_kwargs(model_path, seed)))

    return AsyncLLMBridge(loop.run(build()), loop)


def _share_ray_address() -> None:
    """vLLM's engine process (spawned) starts the Ray executor's workers:
    it must join this actor's Ray, and the group it finds (vLLM reads the
    actor's placement group and hands it to that process). vLLM exports
    ``RAY_ADDRESS`` only when it switches to spawn itself, and the spawn set
    above keeps it from doing so."""
    import ray

    if ray.is_initialized():
        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)


def _sampling_params(**options):
    from vllm import SamplingParams

    return SamplingParams(**options)


class _VLLMEngine(ServingEngine):
    """What generation and logprob engines share: the LLM, weight sync, sleep."""

    NAME = "vLLM"

    def __init__(self, llm, tokenizer, options: VLLMOptions, make_sampling_params=None):
        super().__init__(tokenizer)
        self.llm = llm
        self.options = options
        self._make_sampling_params = make_sampling_params or _sampling_params

    def update_weights(self, bucket: Mapping[str, Any], version: int, last: bool) -> None:
        self._require_awake("update_weights")
        self._sync.check_accepts(version)
        self.llm.collective_rpc(STAGE_WEIGHTS_RPC, args=(pack_bucket(bucket_items(bucket)),))
        if last:
            self.llm.collective_rpc(APPLY_WEIGHTS_RPC)
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self._sync.receive(version, last)

    def _sleeps(self) -> bool:
        return self.options.sleep

    def _release_memory(self) -> None:
        self.llm.sleep(level=self.options.level)

    def _resume_memory(self) -> None:
        self.llm.wake_up()


class VLLMGenerator(ServingGeneration, _VLLMEngine):
    """``protocols.GenerationEngine`` over vLLM."""

    def __init__(self, llm, tokenizer, options: VLLMOptions = VLLMOptions(), *, max_new_tokens: int = 64,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop_token_ids: Sequence[int] = (),
                 make_sampling_params=None):
        self._set_sampling(max_new_tokens, temperature, top_p, top_k, stop_token_ids)
        super().__init__(llm, tokenizer, options, make_sampling_params)

    @classmethod
    def from_path(cls, model_path: str, options: VLLMOptions = VLLMOptions(), seed: int = 0, **sampling):
        """A streaming generator over ``AsyncLLM``."""
        return cls(create_async_llm(model_path, options, seed), load_tokenizer(model_path), options, **sampling)

    @property
    def streams(self) -> bool:
        """Over ``AsyncLLM``: the batcher starts each group alone (``start_group``)."""
        return hasattr(self.llm, "submit_generate")

    def start_group(self, request: tuple[Sequence[Prompt], int, int]) -> Future:
        """Submit one group now; a future of its batch, tagged with the version it started with
        (the batcher swaps weights only once no group is in flight)."""
        self._require_ready()
        prompts, n, seed = request
        ids = prompt_token_ids(self.tokenizer, prompts)
        params = [self._make_sampling_params(**sampling_options(n, self.max_new_tokens, self.temperature,
                                                                self.top_p, request_seed, self.top_k,
                                                                self.stop_token_ids))
                  for request_seed in request_seeds(seed, len(ids))]
        version = self.version
        outputs = self.llm.submit_generate([{"prompt_token_ids": row} for row in ids], params)
        return then(outputs, lambda done: batch_from_outputs(ids, done, n, version))

    def generate_groups(self, requests: Sequence[tuple[Sequence[Prompt], int, int]]) -> list[Batch | ValueError]:
        """One batch per ``(prompts, samples_per_prompt, seed)`` request, all
        decoded by ONE ``llm.generate`` call (vLLM batches them continuously)
        and split back per request. A request whose prompts cannot be encoded
        comes back as its ``ValueError``; the others still run."""
        self._require_ready()
        encoded = [encode_or_error(self.tokenizer, prompts) for prompts, _, _ in requests]
        runnable = [(ids, n, seed) for ids, (_, n, seed) in zip(encoded, requests) if not isinstance(ids, ValueError)]
        inputs = [{"prompt_token_ids": row} for ids, _, _ in runnable for row in ids]
        params = [self._make_sampling_params(**sampling_options(n, self.max_new_tokens, self.temperature, self.top_p,
                                                                request_seed, self.top_k, self.stop_token_ids))
                  for ids, n, seed in runnable for request_seed in request_seeds(seed, len(ids))]
        outputs = iter(self.llm.generate(inputs, params, use_tqdm=False) if inputs else [])
        return [ids if isinstance(ids, ValueError)  # batch_from_outputs checks each request got its outputs
                else batch_from_outputs(ids, list(itertools.islice(outputs, len(ids))), n, self.version)
                for ids, (_, n, _) in zip(encoded, requests)]

    def generate_greedy(self, prompts: list[Prompt]) -> list[str]:
        """One argmax response per prompt, for evaluation."""
        self._require_ready()
        ids = prompt_token_ids(self.tokenizer, prompts)
        params = self._make_sampling_params(**sampling_options(1, self.max_new_tokens, 0.0, 1.0, None,
                                                               stop_token_ids=self.stop_token_ids))
        outputs = self.llm.generate([{"prompt_token_ids": row} for row in ids], params, use_tqdm=False)
        return decode_responses(self.tokenizer, batch_from_outputs(ids, outputs, 1, self.version))


# -- log-probabilities of given responses ------------------------------------------------


def logprobs_from_prompt_logprobs(rows: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
                                  response_lengths: Sequence[int], outputs: Iterable[Any],
                                  width: int) -> torch.Tensor:
    """vLLM ``prompt_logprobs`` (one dict per prompt position, None first) ->
    float32 [n, width] log-probabilities of the response tokens, 0 elsewhere."""
    result = torch.zeros(len(rows), width, dtype=torch.float32)
    for row, (tokens, start, length, output) in enumerate(zip(rows, prompt_lengths, response_lengths, outputs)):
        per_position = output.prompt_logprobs
        for j in range(length):
            result[row, j] = per_position[start + j][tokens[start + j]].logprob
    return result


class VLLMLogprob(_VLLMEngine):
    """``protocols.LogprobEngine`` over vLLM: each row is scored as a prompt
    (``prompt_logprobs``) with one throwaway generated token."""

    @classmethod
    def from_path(cls, model_path: str, options: VLLMOptions = VLLMOptions(), seed: int = 0):
        return cls(create_llm(model_path, options, seed), load_tokenizer(model_path), options)

    def logprobs(self, batch: Batch) -> torch.Tensor:
        self._require_ready()
        rows, starts, lengths = scoring_rows(batch)
        params = self._make_sampling_params(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": row} for row in rows], params, use_tqdm=False)
        return logprobs_from_prompt_logprobs(rows, starts, lengths, outputs, batch[FIELD_RESPONSE_IDS].shape[1])
