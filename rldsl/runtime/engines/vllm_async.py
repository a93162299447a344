"""vLLM's ``AsyncLLM`` on an event-loop thread of its own (``AsyncVLLM``).

What the vLLM engines (vllm.py) need of vLLM, in calls that return at once
(``submit``: a ``concurrent.futures.Future``) or wait (``run``):

- a group: one request per prompt with ``n`` samples, streamed as deltas
  (``RequestOutputKind.DELTA``): each child's tokens and sampled-token
  logprobs are gathered as they come, and the group is answered once every
  child of every prompt has ended. (With vLLM's default cumulative outputs
  and ``n > 1`` the final output holds only the last child to finish.)
  Every streamed token is counted (``tokens_decoded``: the watchdog's
  measure of progress);
- the weight version of every token, from vLLM's own counter: a child
  reports, when it ends, the spans of its tokens each version sampled
  (``CompletionOutput.weight_versions``);
- weights in place, between requests or with requests in flight:
  ``pause_generation(mode="keep")``, each bucket loaded by the workers, the
  version set, the prefix cache reset (running requests recompute theirs
  under the new weights), ``resume_generation``. The buckets reach the
  workers through shared memory (``load_weights``, vllm_worker.py), or
  straight from the trainer, the workers standing in its weight group
  (``join_weight_group``, ``receive_stream``: vLLM's weight-transfer calls
  with rldsl's backend, vllm_receiver.py). Refused for a mixture of
  experts on vLLM's CPU build, which reloads its layers wrongly
  (``moe_reload_refused``);
- LoRA adapters (``load_adapter``): each version written as PEFT's
  directory and added to vLLM as a ``LoRARequest`` of its own, which the
  requests submitted after it name; the version before it removed. Several
  pipelines' adapters can live side by side (``name``: whose), each
  request naming its own, batched together by vLLM;
- ``abort``: every request in flight ends now (a stop, a timeout), or
  only those of one ``owner`` (a pipeline the engine serves).

vLLM is imported only when an engine is built (``AsyncVLLM.start``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

from rldsl.plan import hf_expert_count
from rldsl.runtime.engines.serving import EventLoopThread
from rldsl.runtime.engines.vllm_worker import LOAD_BUCKET_RPC

SHARED_MEMORY = "/dev/shm"  # where buckets wait for the workers to read them (a temp dir if absent)
STREAM_BACKEND = "rldsl-stream"  # vLLM's weight-transfer backend whose workers join weight groups (vllm_receiver.py)
STREAM_STATS_RPC = "rldsl_stream_stats"
_CALL_OFF_POLL_S = 0.05


@dataclass
class Sample:
    """One child of a request: its tokens, the logprob of each, the version of each."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[tuple[int, int, int]] = field(default_factory=list)  # (version, start, end) spans
    finish_reason: str | None = None


class AsyncVLLM:
    """``AsyncLLM`` driven from threads; see the module docstring."""

    def __init__(self, engine, loop: EventLoopThread, reload_refused: str | None = None) -> None:
        self.engine, self.loop = engine, loop
        self.reload_refused = reload_refused  # why weights cannot be loaded in place (None: they can)
        self.tokens_decoded = 0
        self._ids = itertools.count()
        self._adapter_ids = itertools.count(1)  # vLLM's LoRA ids start at 1
        self._in_flight: dict[str, str] = {}  # request id -> its owner

    @classmethod
    def start(cls, engine_args: Mapping[str, Any], version: int = 0) -> AsyncVLLM:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        loop = EventLoopThread("vllm-async")

        async def build():  # inside the loop: AsyncLLM's output handler binds to the running loop
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
            await engine.update_weight_version(str(version))
            return engine

        return cls(loop.run(build()), loop, moe_reload_refused(engine_args["model"]))

    # -- generation --------------------------------------------------------------------

    def submit(self, prompts: Sequence[Sequence[int]], params: Sequence, adapter=None, owner: str = "") -> Future:
        """Each prompt a request with its own ``SamplingParams`` (``n`` children),
        on the LoRA ``adapter`` if given (a ``LoRARequest``); a future of, per
        prompt, its samples in child order. ``owner``: whose requests they
        are, for ``abort``."""
        return self.loop.submit(self._requests(prompts, params, adapter, owner))

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence, adapter=None,
                 owner: str = "") -> list[list[Sample]]:
        return self.submit(prompts, params, adapter, owner).result()

    def score(self, rows: Sequence[Sequence[int]], params) -> list:
        """Each row once as a prompt (``prompt_logprobs``): its final outputs."""
        return self.loop.run(self._finals(rows, params))

    async def _finals(self, rows, params) -> list:
        return list(await asyncio.gather(*(self._final(row, params) for row in rows)))

    async def _requests(self, prompts, params, adapter=None, owner: str = "") -> list[list[Sample]]:
        return list(await asyncio.gather(*(self._request(list(p), sp, adapter, owner)
                                           for p, sp in zip(prompts, params))))

    async def _request(self, prompt: list[int], params, adapter=None, owner: str = "") -> list[Sample]:
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.DELTA
        samples = [Sample() for _ in range(params.n)]
        request_id = f"rldsl-{next(self._ids)}"
        self._in_flight[request_id] = owner
        try:
            async for output in self.engine.generate({"prompt_token_ids": prompt}, params, request_id=request_id,
                                                     lora_request=adapter):
                for delta in output.outputs:
                    self._take(samples[delta.index], delta)
        finally:
            self._in_flight.pop(request_id, None)
        return samples

    def _take(self, sample: Sample, delta) -> None:
        tokens = list(delta.token_ids)
        if tokens and delta.logprobs is None:
            raise RuntimeError("vLLM returned no logprobs; the request must ask for logprobs = 0")
        sample.token_ids += tokens
        sample.logprobs += [step[token].logprob for token, step in zip(tokens, delta.logprobs or [])]
        self.tokens_decoded += len(tokens)
        if delta.finish_reason is not None:
            sample.finish_reason = delta.finish_reason
            sample.versions = [(int(s.version), s.start, s.end) for s in delta.weight_versions or []]

    async def _final(self, prompt: list[int], params):
        request_id = f"rldsl-{next(self._ids)}"
        final = None
        async for output in self.engine.generate({"prompt_token_ids": prompt}, params, request_id=request_id):
            final = output
        return final

    def abort(self, owner: str | None = None) -> int:
        """End every request in flight now (only ``owner``'s when given); returns how many."""
        request_ids = sorted(r for r, whose in list(self._in_flight.items()) if owner is None or whose == owner)
        if request_ids:
            self.loop.run(self.engine.abort(request_ids))
        return len(request_ids)

    # -- weights -----------------------------------------------------------------------

    def load_weights(self, buckets: Iterable[list[tuple[str, Any]]], version: int) -> None:
        """Every bucket in place, generation paused (requests in flight kept) meanwhile."""
        if self.reload_refused:
            raise RuntimeError(self.reload_refused)
        self.loop.run(self._load(buckets, version))

    async def _load(self, buckets, version: int) -> None:
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        try:
            buckets = list(buckets)
            for index, bucket in enumerate(buckets):
                await self._load_bucket(bucket, index == 0, index == len(buckets) - 1)
            await self._set_version(version)
        finally:
            await self.engine.resume_generation()

    async def _set_version(self, version: int) -> None:
        await self.engine.update_weight_version(str(version))
        # KV computed with the old weights goes; running requests recompute theirs under the new ones
        if not await self.engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")

    async def _load_bucket(self, bucket: list[tuple[str, Any]], first: bool, last: bool) -> None:
        from safetensors.torch import save_file

        directory = SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else None
        handle, path = tempfile.mkstemp(prefix="rldsl-bucket-", suffix=".safetensors", dir=directory)
        os.close(handle)
        try:
            save_file(dict(bucket), path)
            await self.engine.collective_rpc(LOAD_BUCKET_RPC, args=(path, first, last))
        finally:
            os.unlink(path)

    def join_weight_group(self, init_info: Mapping[str, Any]) -> None:
        """Every worker joins a weight group (``vllm_receiver.StreamInitInfo``'s fields)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.loop.run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=dict(init_info))))

    def receive_stream(self, version: int, called_off: Callable[[], bool], called_off_file: str) -> list[dict]:
        """Every worker receives ``version`` from its weight group, generation
        paused (requests in flight kept) meanwhile; returns what each worker's
        stream moved. While they wait, ``called_off`` is asked whether the
        push was called off; if so ``called_off_file`` is created, which the
        workers' transfers watch."""
        if self.reload_refused:
            raise RuntimeError(self.reload_refused)
        future = self.loop.submit(self._receive_stream(version))
        while not wait([future], timeout=_CALL_OFF_POLL_S).done:
            if not os.path.exists(called_off_file) and called_off():
                open(called_off_file, "w").close()
        return future.result()

    async def _receive_stream(self, version: int) -> list[dict]:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.engine.pause_generation(mode="keep", clear_cache=False)
        # a push that fails leaves vLLM paused: its workers hold part of the version, from which no token may
        # be sampled; the version's copy through the object store (what follows a failed push) loads it whole
        # and resumes the requests kept
        await self.engine.start_weight_update()
        await self.engine.update_weights(WeightTransferUpdateRequest(update_info={"version": version}))
        await self.engine.finish_weight_update()
        stats = await self.engine.collective_rpc(STREAM_STATS_RPC)
        await self._set_version(version)
        await self.engine.resume_generation()
        return stats

    def load_adapter(self, tensors: Mapping[str, Any], config: Mapping[str, Any], version: int, previous=None,
                     name: str = "rldsl", sets_version: bool = True):
        """LoRA adapters (PEFT's names and ``adapter_config.json``) as vLLM's
        adapter of ``version``, which requests name from now on; vLLM's
        version set (``sets_version``: not where several pipelines' adapters
        share the engine, each at a version of its own), the ``previous``
        adapter removed (no request in flight uses it: versions land between
        requests). Returns its ``LoRARequest``."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        directory = tempfile.mkdtemp(prefix=f"rldsl-adapter-v{version}-",
                                     dir=SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else None)
        try:  # written here, not on the event loop that streams the requests' tokens
            with open(os.path.join(directory, "adapter_config.json"), "w") as file:
                json.dump(dict(config), file)
            save_file(dict(tensors), os.path.join(directory, "adapter_model.safetensors"))
            adapter = LoRARequest(f"{name}-v{version}", next(self._adapter_ids), directory)
            return self.loop.run(self._add_adapter(adapter, version, previous, sets_version))
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    async def _add_adapter(self, adapter, version: int, previous, sets_version: bool):
        if not await self.engine.add_lora(adapter):
            raise RuntimeError(f"vLLM refused the LoRA adapter of version {version}")
        if sets_version:
            await self.engine.update_weight_version(str(version))
        if previous is not None:
            await self.engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        return adapter

    async def weight_version(self) -> int:
        return int(await self.engine.get_weight_version())

    def current_version(self) -> int:
        return self.loop.run(self.weight_version())

    # -- memory ------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        self.loop.run(self.engine.sleep(level))

    def wake_up(self) -> None:
        self.loop.run(self.engine.wake_up())

    def shutdown(self) -> None:
        """Stop vLLM. Its output handler is cancelled first: vLLM's own
        shutdown ends the engine process before it, and the handler would
        log the engine's end as a failure."""
        self.loop.run(self._cancel_output_handler())
        engine, self.engine = self.engine, None
        engine.shutdown()  # and released now: at interpreter exit vLLM's __del__ would shut down a torn-down module
        self.loop.close()

    async def _cancel_output_handler(self) -> None:
        handler = getattr(self.engine, "output_handler", None)
        if handler is not None and not handler.done():
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)


def moe_reload_refused(model_path: str) -> str | None:
    """Why new weights cannot go into this model in place: vLLM's CPU build
    (0.32) reloads a mixture of experts wrongly, through its own
    ``reload_weights`` as through ours, while a dense model reloads exactly
    (bench/vllm_moe_push.py); None on a GPU, for a dense model, or when the
    config cannot be read."""
    import torch

    if torch.cuda.is_available():
        return None
    try:
        with open(os.path.join(model_path, "config.json")) as file:
            config = json.load(file)
    except (OSError, ValueError):
        return None
    if not hf_expert_count(config):
        return None
    return (f"vLLM's CPU build reloads a mixture of experts' weights wrongly (the model at {model_path}: its "
            "log-probabilities then differ from the same weights' in transformers by up to 0.5, with vLLM's own "
            "reload too; docs/engines.md), so no version can be pushed into it: generate with `engine = torch` "
            "on a CPU, or run vLLM on a GPU")
