"""Held-out evaluation on the generator replicas (``dataset { eval_on = generators }``).

The CPU evaluator (evaluation.py) costs the run nothing but decodes a
whole copy of the policy on the CPU, which for a large model takes longer
than the run. With ``eval_on = generators`` a generator replica decodes the
evaluation prompts itself, through its batcher: once the rows in flight
have ended, between two batches (``ContinuousBatcher.run_idle``), with the
weights it holds then (the result says which version), at the evaluation's
own sampling (greedy, or ``eval_samples`` at ``eval_temperature`` /
``eval_top_p``). The responses are scored as the evaluator scores them
(``score`` with the same ``EvalMetric``), in the call's thread, so the
replica generates again as soon as decoding ends. Evaluation requests go
from the driver to the replica, never through the controller: they are no
training samples (no ledger, journal or buffer entry).

The cost: the replica generates nothing while it evaluates. So a decode is
cut into chunks, checked against ``run { eval_timeout }`` between two of
them: an evaluation past its deadline stops and is reported as timed out,
and the replica goes back to generating. Each evaluation goes to the next
replica in turn that is not evaluating already; while none is free it waits
(its deadline counting from the request).
"""

from __future__ import annotations

import threading
import time

from rldsl.plan import PipelinePlan
from rldsl.runtime.ray_lowering.evaluation import EvalMetric, EvalSampling, EvaluationSchedule, eval_seed, \
    held_out_prompts, score
from rldsl.runtime.ray_lowering.supervision import remote_call

EVAL_PROMPTS_PER_DECODE = 16  # between two chunks the deadline is checked


class ReplicaEvaluation:
    """A generator worker's side: the prompts, the sampling and the metric,
    loaded on the first evaluation."""

    def __init__(self, pipe: PipelinePlan, replica: int):
        self.prompts = held_out_prompts(pipe)
        self.sampling = EvalSampling.of(pipe)
        self.metric = EvalMetric(pipe)
        if self.metric.episodes:  # `check` refuses it (RLP609): only a hand-made plan gets here
            raise ValueError("episodes are evaluated on the evaluator, not on the generators: remove "
                             "`eval_on = generators` from the dataset")
        self.seed, self.replica = pipe.run.seed, replica
        self._one_at_a_time = threading.Lock()

    def evaluate(self, batcher, timeout_s: float = 0.0) -> dict:
        """Scores of the weights ``batcher``'s engine holds when decoding
        starts; ``timed_out`` instead when ``timeout_s`` (0: none) ran out first."""
        deadline = time.monotonic() + timeout_s if timeout_s else None
        with self._one_at_a_time:
            version, responses = batcher.run_idle(lambda engine: self.decode(engine, deadline))
        result = {"metric": self.metric.name, "version": version, "prompts": len(self.prompts),
                  "samples": 1 if self.sampling.greedy else self.sampling.samples, "on": "generators",
                  "replica": self.replica}
        if len(responses) < len(self.prompts):
            return {**result, "timed_out": True, "decoded": len(responses)}
        return {**score(responses, self.prompts, self.metric), **result}

    def decode(self, engine, deadline: float | None) -> tuple[int, list[list[str]]]:
        """On the decode thread, no rows in flight: the responses of the
        prompts decoded before ``deadline``, chunk by chunk, and the version."""
        if not all(hasattr(engine, name) for name in ("generate_greedy", "generate", "decode")):
            raise RuntimeError(f"the {type(engine).__name__} engine decodes no text: evaluate with "
                               "`eval_on = evaluator` on the dataset")
        version, responses = int(engine.version), []
        sampled = not self.sampling.greedy
        saved = (engine.temperature, engine.top_p, engine.top_k)
        try:
            if sampled:  # the engine samples at the run's settings; evaluation at its own (no top-k, as the
                # CPU evaluator), restored after
                engine.temperature, engine.top_p, engine.top_k = self.sampling.temperature, self.sampling.top_p, 0
            for start in range(0, len(self.prompts), EVAL_PROMPTS_PER_DECODE):
                if deadline is not None and time.monotonic() >= deadline:
                    break
                chunk = self.prompts[start:start + EVAL_PROMPTS_PER_DECODE]
                responses += self._responses(engine, chunk, eval_seed(self.seed, version, start)) if sampled \
                    else [[text] for text in engine.generate_greedy(chunk)]
        finally:
            engine.temperature, engine.top_p, engine.top_k = saved
        return version, responses

    def _responses(self, engine, prompts: list, seed: int) -> list[list[str]]:
        samples = self.sampling.samples
        texts = engine.decode(engine.generate(prompts, samples, seed=seed))
        return [texts[i * samples:(i + 1) * samples] for i in range(len(prompts))]


class GeneratorEvaluations(EvaluationSchedule):
    """The driver's side: an ``EvaluationSchedule`` whose requests go to the
    generator replicas' ``evaluate``, one evaluation per replica at a time.
    A replica whose actor died takes no more (the controller replaces it
    under another handle); its evaluation is reported as failed."""

    def __init__(self, replicas: list, every: int, total_steps: int, previous: list[dict] | None = None,
                 timeout_s: float = 0.0, clock=time.monotonic, at_start: bool = True, at_end: bool = True,
                 tenant: str | None = None):
        super().__init__(None, every, total_steps, previous, timeout_s, clock, at_start, at_end)
        self.replicas = list(replicas)
        self.tenant = tenant  # the pipeline whose side of another pipeline's generators evaluates (`served_by`)
        self.running: dict[int, object] = {}  # replica -> its evaluate call not yet ended
        self.waiting: list[tuple[int, int, float]] = []  # (step, version, asked at): every replica was busy
        self.gone: set[int] = set()
        self.asked: dict = {}  # each evaluate call's ObjectRef -> its replica
        self._turn = 0

    def request(self, step: int, version: int) -> None:
        self.waiting.append((step, version, self.clock()))
        self._dispatch()

    def collect(self, wait: bool = False) -> tuple[list[dict], list[dict]]:
        finished, expired = [], []
        while True:
            self._dispatch()
            expired += self._expire_waiting(final=wait and self._all_gone())
            done, late = super().collect(wait)
            finished, expired = finished + done, expired + late
            if not (wait and self.waiting):
                return finished, expired
            self._wait_for_a_replica()

    def _dispatch(self) -> None:
        import ray

        for replica, ref in list(self.running.items()):
            if ray.wait([ref], timeout=0)[0]:
                del self.running[replica]
        while self.waiting:
            replica = self._free_replica()
            if replica is None:
                return
            step, version, asked_at = self.waiting.pop(0)
            left = max(0.1, asked_at + self.timeout_s - self.clock()) if self.timeout_s else 0.0
            ref = remote_call(self.replicas[replica], "evaluate", left, tenant=self.tenant)
            self.running[replica], self.asked[ref] = ref, replica
            self.pending.append((step, version, ref, asked_at))

    def _free_replica(self) -> int | None:
        count = len(self.replicas)
        for offset in range(count):
            replica = (self._turn + offset) % count
            if replica not in self.running and replica not in self.gone:
                self._turn = replica + 1
                return replica
        return None

    def _all_gone(self) -> bool:
        return len(self.gone) == len(self.replicas)

    def _expire_waiting(self, final: bool) -> list[dict]:
        """Requests that waited for a free replica past their deadline
        (``final``: all of them, no replica is left to answer)."""
        kept, expired = [], []
        for step, version, asked_at in self.waiting:
            if final:
                expired.append({"step": step, "version": version, "error": "no generator replica is left"})
            elif self._overdue(asked_at):
                expired.append({"step": step, "version": version, "timeout_s": self.timeout_s})
            else:
                kept.append((step, version, asked_at))
        self.waiting = kept
        self.timed_out += [entry for entry in expired if "error" not in entry]
        self.failed += [entry for entry in expired if "error" in entry]
        return expired

    def _wait_for_a_replica(self) -> None:
        import ray

        if not self.running:
            return
        oldest = min(asked_at for _, _, asked_at in self.waiting)
        ray.wait(list(self.running.values()), num_returns=1, timeout=self._wait_s(oldest, True))

    def _actor_died(self, step: int, version: int, ref, error: BaseException, expired: list[dict]) -> bool:
        replica = self.asked.pop(ref, None)
        if replica is not None:
            self.gone.add(replica)
            self.running.pop(replica, None)
        self._failure(step, version, error, expired)
        return False


def generator_schedule(pipe: PipelinePlan, handles: dict[str, list], total_steps: int,
                       previous: list[dict] | None = None) -> GeneratorEvaluations:
    """The schedule over every generator replica of the pipeline, in stage order."""
    generators = [stage for stage in pipe.stages if stage.kind == "generate"]
    replicas = [actor for stage in generators for actor in handles[stage.name]]
    served = any(stage.served_by for stage in generators)
    return GeneratorEvaluations(replicas, pipe.run.eval_every, total_steps, previous, pipe.run.eval_timeout_s,
                                at_start=pipe.run.eval_at_start, at_end=pipe.run.eval_at_end,
                                tenant=pipe.name if served else None)
