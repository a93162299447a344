"""The sim engines: the engine protocols without models.

Engines draw seeded latencies (``sim_latency``) and return data of the real
shapes, so the controller, the data plane and the Ray layer run end to end
without a model. Sleeping: the protocol methods block with ``time.sleep``, as
a real engine inside a Ray actor does; their ``*_async`` twins await
``asyncio.sleep`` so that ``SimStages`` can simulate many concurrent workers
on the controller's own event loop.

``SimTrainer`` is a dry-run trainer that enforces the split-step protocol:
``begin`` while a step is open raises, a microbatch, optimizer step or
finish with no open step or for another step raises, ``abort`` is
idempotent; it records calls and reports the learning rate its schedule
gives each optimizer step.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Collection, Iterator, Mapping, Sequence

import torch

from rldsl.runtime import protocols as p
from rldsl.runtime.engines.schedule import LRSchedule
from rldsl.runtime.engines.sim.latency import Latency, Timed
from rldsl.runtime.protocols import MIB


GroupRequest = tuple[Sequence[p.Prompt], int, int]  # (prompts, samples_per_prompt, seed)


class SimFailure(RuntimeError):
    """An injected engine failure."""


class SplitStepError(RuntimeError):
    """A split-step protocol violation caught by the dry-run trainer."""


class SimGenerator(Timed):
    """``GenerationEngine``: random tokens of realistic shapes.

    ``generate_groups`` serves several prompt groups in one call, as a
    batching engine does: the call costs one latency draw plus ``per_group``
    seconds for each group after the first (default: 10% of the typical
    latency), so batching is much cheaper than one call per group. With
    ``longest_in_wave`` each group draws its own decode time and the call
    lasts as long as its longest (a real engine's wave).

    ``streaming``: ``start_group`` decodes each group on its own clock (its
    own draw plus ``per_group`` for every other group in flight when it
    starts) and completes its future when that group ends, whatever else is
    in flight: a ``ContinuousBatcher`` then answers groups independently."""

    PER_GROUP_SHARE = 0.1  # the default per_group, as a share of the typical latency

    def __init__(self, latency: Latency = Latency(), vocab_size: int = 64, prompt_len: int = 8,
                 max_new_tokens: int = 16, fail_prob: float = 0.0, seed: int = 0,
                 per_group: float | None = None, streaming: bool = False, longest_in_wave: bool = False,
                 min_new_tokens: int = 0) -> None:
        super().__init__(latency, seed)
        self.vocab_size, self.prompt_len, self.max_new_tokens = vocab_size, prompt_len, max_new_tokens
        self.min_new_tokens = max(1, min(min_new_tokens, max_new_tokens))  # every sim response has a token
        self.fail_prob = fail_prob
        self.per_group = self.PER_GROUP_SHARE * latency.typical if per_group is None else per_group
        if self.per_group < 0:
            raise ValueError(f"per_group must be >= 0, got {self.per_group}")
        self.streams, self.longest_in_wave = streaming, longest_in_wave
        self.version = 0
        self.asleep = False
        self._active = 0  # calls and streamed groups decoding now
        self._active_lock = threading.Lock()
        self._incoming: int | None = None  # version of a push in progress

    @property
    def generating(self) -> bool:
        return self._active > 0

    def generate(self, prompts: list[p.Prompt], samples_per_prompt: int, seed: int) -> p.Batch:
        with self._generating():
            time.sleep(self._draw())
            return self._batch(prompts, samples_per_prompt, seed)

    async def generate_async(
        self, prompts: Sequence[p.Prompt], samples_per_prompt: int, seed: int, requested_at: float | None = None
    ) -> p.Batch:
        with self._generating():
            await self._hold(self._draw(), requested_at)
            return self._batch(prompts, samples_per_prompt, seed)

    def generate_groups(self, requests: Sequence[GroupRequest]) -> list[p.Batch]:
        """One batch per ``(prompts, samples_per_prompt, seed)`` request, from
        one call (an injected failure fails the whole call, as in ``generate``)."""
        with self._generating():
            time.sleep(self._group_call_seconds(requests))
            return [self._batch(*request) for request in requests]

    async def generate_groups_async(self, requests: Sequence[GroupRequest],
                                    requested_at: float | None = None) -> list[p.Batch]:
        with self._generating():
            await self._hold(self._group_call_seconds(requests), requested_at)
            return [self._batch(*request) for request in requests]

    def start_group(self, request: GroupRequest) -> Future:
        """Start decoding one group now (streaming); its future holds the batch."""
        future: Future = Future()
        with self._generating(release=False):
            seconds = self._draw() + self.per_group * (self._active - 1)
            batch = self._batch(*request)  # the version it starts with: weights change only between groups
        timer = threading.Timer(seconds, self._end_stream, (future, batch))
        timer.daemon = True
        timer.start()
        return future

    def _end_stream(self, future: Future, batch: p.Batch) -> None:
        self._count_active(-1)
        future.set_result(batch)

    def update_weights(self, bucket: Mapping[str, Any], version: int, last: bool) -> None:
        if self.generating:
            raise SplitStepError(f"weights version {version} pushed while a group is mid-generation")
        self._incoming = version
        if last:
            self.version, self._incoming = version, None

    def sleep(self) -> None:
        self.asleep = True

    def wake(self) -> None:
        self.asleep = False

    @contextmanager
    def _generating(self, release: bool = True) -> Iterator[None]:
        """Counts a call (or, ``release`` False, a streamed group that ends later) as decoding."""
        if self._incoming is not None:
            raise SplitStepError("generate while a weight push is half done (mixed weights)")
        if self._chance(self.fail_prob):
            raise SimFailure("injected generation failure")
        self._count_active(1)
        try:
            yield
        except BaseException:
            self._count_active(-1)
            raise
        if release:
            self._count_active(-1)

    def _count_active(self, change: int) -> None:
        with self._active_lock:
            self._active += change

    def _group_call_seconds(self, requests: Sequence[GroupRequest]) -> float:
        if not requests:
            raise ValueError("generate_groups needs at least one request")
        longest = max(self._draw() for _ in requests) if self.longest_in_wave else self._draw()
        return longest + self.per_group * (len(requests) - 1)

    def _batch(self, prompts: Sequence[p.Prompt], samples_per_prompt: int, seed: int) -> p.Batch:
        rows = len(prompts) * samples_per_prompt
        rng = torch.Generator().manual_seed(seed)
        prompt_lens = torch.randint(1, self.prompt_len + 1, (len(prompts),), generator=rng)
        prompt_lens = prompt_lens.repeat_interleave(samples_per_prompt)  # a group shares its prompt
        response_lens = torch.randint(self.min_new_tokens, self.max_new_tokens + 1, (rows,), generator=rng)
        columns_p = torch.arange(self.prompt_len)
        prompt_mask = (columns_p >= self.prompt_len - prompt_lens[:, None]).long()  # left-padded
        response_mask = (torch.arange(self.max_new_tokens) < response_lens[:, None]).long()  # right-padded
        return {
            p.FIELD_PROMPT_IDS: torch.randint(1, self.vocab_size, (rows, self.prompt_len), generator=rng) * prompt_mask,
            p.FIELD_PROMPT_MASK: prompt_mask,
            p.FIELD_RESPONSE_IDS: torch.randint(1, self.vocab_size, (rows, self.max_new_tokens), generator=rng)
            * response_mask,
            p.FIELD_RESPONSE_MASK: response_mask,
            p.FIELD_BEHAVIOUR_LOGPROBS: _fake_logprobs(response_mask, rng),
            p.FIELD_VERSION: torch.full((rows,), self.version, dtype=torch.int64),
        }


class SimRewardWorker(Timed):
    """Scores a group in one call: 1.0 with ``success_prob``, else 0.0; a
    sample fails (None) with ``fail_prob``; the call raises with ``call_fail_prob``."""

    def __init__(self, latency: Latency = Latency(), success_prob: float = 0.5, fail_prob: float = 0.0,
                 call_fail_prob: float = 0.0, seed: int = 0) -> None:
        super().__init__(latency, seed)
        self.success_prob, self.fail_prob, self.call_fail_prob = success_prob, fail_prob, call_fail_prob

    async def score_async(self, count: int, requested_at: float | None = None) -> list[float | None]:
        await self._hold(self._draw(), requested_at)
        if self._chance(self.call_fail_prob):
            raise SimFailure("injected reward worker failure")
        return [None if self._chance(self.fail_prob) else float(self._chance(self.success_prob)) for _ in range(count)]


class SimLogprob(Timed):
    """``LogprobEngine``: random log-probabilities, 0 off the response mask."""

    def logprobs(self, batch: p.Batch) -> torch.Tensor:
        time.sleep(self._draw())
        return self._values(batch)

    async def logprobs_async(self, batch: p.Batch) -> torch.Tensor:
        await self._hold(self._draw())
        return self._values(batch)

    def update_weights(self, bucket: dict, version: int, last: bool) -> None:
        """A policy logprob stage's push: the sim has no weights, only the version."""
        if last:
            self.version = version

    def weight_snapshot(self) -> list[dict]:
        """The weights as buckets ``update_weights`` takes back: the sim has none."""
        return [{}]

    def _values(self, batch: p.Batch) -> torch.Tensor:
        return _fake_logprobs(batch[p.FIELD_RESPONSE_MASK], torch.Generator().manual_seed(self._rng.getrandbits(31)))


class SimTrainer:
    """``Trainer``: a dry-run split-step trainer.

    ``fail_on`` holds (call, step) pairs that raise ``SimFailure`` once each;
    ``fail_prob`` makes any microbatch, optimizer step or finish raise at
    random. ``calls`` records (call, step, rows) in order. An optimizer step
    costs a finish latency; one with no rows since the last is skipped."""

    exports_beside_steps = True  # its weights are one local blob (handles.StageHandles.export_overlaps)

    def __init__(self, microbatch_latency: Latency = Latency(), finish_latency: Latency = Latency(),
                 fail_on: Collection[tuple[str, int]] = (), fail_prob: float = 0.0, weight_bytes: int = MIB,
                 seed: int = 0, lr: float = 0.0, lr_schedule: LRSchedule | None = None) -> None:
        self._microbatch = Timed(microbatch_latency, seed)
        self._finish = Timed(finish_latency, seed + 1)
        self._fail_on = set(fail_on)
        self.fail_prob = fail_prob
        self.weight_bytes = weight_bytes
        self.base_lr, self.lr_schedule = lr, lr_schedule or LRSchedule()
        self.version = 0
        self.optimizer_steps = 0  # over the whole run: the schedule's clock, kept in checkpoints
        self.open_step: int | None = None
        self.calls: list[tuple[str, int, int]] = []
        self._rows_in_step = 0  # since the last optimizer step
        self._steps_in_batch = 0  # optimizer steps the open step has taken
        self._weights: torch.Tensor | None = None

    def begin_train_step(self, step: int) -> None:
        self.calls.append(("begin_train_step", step, 0))
        if self.open_step is not None:
            raise SplitStepError(f"begin_train_step({step}) while step {self.open_step} is open")
        self.open_step, self._rows_in_step, self._steps_in_batch = step, 0, 0

    def train_microbatch(self, step: int, batch: p.Batch) -> dict[str, float]:
        time.sleep(self._before_microbatch(step, batch))
        return self._after_microbatch(batch)

    async def train_microbatch_async(self, step: int, batch: p.Batch) -> dict[str, float]:
        await self._microbatch._hold(self._before_microbatch(step, batch))
        return self._after_microbatch(batch)

    def optimizer_step(self, step: int) -> dict[str, float]:
        time.sleep(self._before_optimizer_step(step))
        return self._after_optimizer_step()

    async def optimizer_step_async(self, step: int) -> dict[str, float]:
        await self._finish._hold(self._before_optimizer_step(step))
        return self._after_optimizer_step()

    def finish_train_step(self, step: int) -> p.StepResult:
        time.sleep(self._before_finish(step))
        return self._after_finish()

    async def finish_train_step_async(self, step: int) -> p.StepResult:
        await self._finish._hold(self._before_finish(step))
        return self._after_finish()

    def abort_train_step(self, step: int) -> None:
        self.calls.append(("abort_train_step", step, 0))
        self.open_step, self._rows_in_step, self._steps_in_batch = None, 0, 0

    def save_checkpoint(self, directory) -> None:
        """A sim trainer's whole state is its version (its weights are zeros):
        enough for runs that are interrupted and resumed to prove the rest."""
        import json
        from pathlib import Path

        Path(directory).mkdir(parents=True, exist_ok=True)
        state = {"version": self.version, "optimizer_steps": self.optimizer_steps}
        (Path(directory) / "sim_trainer.json").write_text(json.dumps(state))

    def load_checkpoint(self, directory) -> int:
        import json
        from pathlib import Path

        state = json.loads((Path(directory) / "sim_trainer.json").read_text())
        self.version, self.optimizer_steps = int(state["version"]), int(state.get("optimizer_steps", 0))
        return self.version

    def weight_buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """Views of ``weight_bytes`` of fake float32 parameters, bucketed."""
        if self._weights is None:
            self._weights = torch.zeros(max(1, self.weight_bytes // 4))  # allocated once: pushes stay cheap
        per_bucket = max(1, bucket_bytes // 4)
        for index, start in enumerate(range(0, len(self._weights), per_bucket)):
            yield {f"layer{index}.weight": self._weights[start : start + per_bucket]}

    def _require_open(self, call: str, step: int) -> None:
        if self.open_step is None:
            raise SplitStepError(f"{call}({step}) with no open step")
        if self.open_step != step:
            raise SplitStepError(f"{call}({step}) but the open step is {self.open_step}")

    def _maybe_fail(self, call: str, step: int) -> None:
        if (call, step) in self._fail_on:
            self._fail_on.discard((call, step))
            raise SimFailure(f"injected {call} failure at step {step}")
        if self._microbatch._chance(self.fail_prob):
            raise SimFailure(f"injected random {call} failure at step {step}")

    def _before_microbatch(self, step: int, batch: p.Batch) -> float:
        self._require_open("train_microbatch", step)
        rows = len(batch[p.FIELD_RESPONSE_MASK])
        if p.FIELD_ADVANTAGE not in batch:
            raise SplitStepError(f"train_microbatch({step}) without the {p.FIELD_ADVANTAGE} field")
        if p.FIELD_VERSION in batch and int(max(batch[p.FIELD_VERSION])) > self.version:
            raise SplitStepError(f"train_microbatch({step}) on samples newer than the trainer's weights")
        self.calls.append(("train_microbatch", step, rows))
        self._maybe_fail("train_microbatch", step)
        return self._microbatch._draw()

    def _after_microbatch(self, batch: p.Batch) -> dict[str, float]:
        rows = len(batch[p.FIELD_RESPONSE_MASK])
        self._rows_in_step += rows
        return {"rows": float(rows), "tokens": float(batch[p.FIELD_RESPONSE_MASK].sum())}

    def _before_optimizer_step(self, step: int) -> float:
        self._require_open("optimizer_step", step)
        self.calls.append(("optimizer_step", step, self._rows_in_step))
        self._maybe_fail("optimizer_step", step)
        return self._finish._draw() if self._rows_in_step else 0.0

    def _after_optimizer_step(self) -> dict[str, float]:
        if not self._rows_in_step:
            return {"skipped": 1.0}
        return self._take_optimizer_step()

    def _take_optimizer_step(self) -> dict[str, float]:
        metrics = {"rows": float(self._rows_in_step), "lr": self.lr_schedule.lr_at(self.optimizer_steps, self.base_lr)}
        self.optimizer_steps += 1
        self._steps_in_batch += 1
        self._rows_in_step = 0
        return metrics

    def _before_finish(self, step: int) -> float:
        self._require_open("finish_train_step", step)
        self.calls.append(("finish_train_step", step, self._rows_in_step))
        self._maybe_fail("finish_train_step", step)
        return self._finish._draw()

    def _after_finish(self) -> p.StepResult:
        """The rollout batch's last optimizer step (always taken: a dry run has
        no empty-step rule to model) and one version bump."""
        metrics = self._take_optimizer_step()
        metrics["optimizer_steps"] = float(self._steps_in_batch)
        self.version += 1
        self.open_step, self._steps_in_batch = None, 0
        return p.StepResult(self.version, metrics)


def _fake_logprobs(response_mask: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
    values = -3.0 * torch.rand(response_mask.shape, generator=rng)
    return values * response_mask

