"""Held-out evaluation on a weight receiver of its own.

The evaluator is one more receiver of the trainer's weight pushes. It keeps
the newest complete version it was sent and, when asked, loads it into a
torch copy of the policy and decodes the evaluation prompts: greedily by
default, or ``eval_samples`` responses per prompt at ``eval_temperature`` /
``eval_top_p``, seeded by the run's seed and the weight version so the same
weights always score the same. So evaluation
- works the same whatever the trainer engine (torch or megatron: both push
  weights named as the policy's own modules),
- never holds up the trainer or a generator (it runs in its own process,
  beside training), and
- scores exactly the weights the generators received.

The copy lives in host memory: for a policy too large to decode on a CPU
in reasonable time, ``eval_size = 0`` on the dataset turns evaluation off.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass

from rldsl.plan import PipelinePlan
from rldsl.runtime.ray_lowering.episode_evaluation import EpisodeEvaluation

_NICENESS = 10


def held_out_prompts(pipe: PipelinePlan) -> list:
    """The evaluation prompts (at most ``eval_size``): the dataset's
    ``eval_source`` when it has one (its eval split; a jsonl file as given,
    ``{split}`` read as ``eval``), else the eval split of its first source."""
    from rldsl.runtime.control.prompts import load_source

    source = pipe.datasets[0].options.get("eval_source") or pipe.datasets[0].source
    return load_source(pipe, source, "eval", pipe.run.seed)[:pipe.eval_size]


@dataclass(frozen=True)
class EvalSampling:
    """How each evaluation decodes; a plan without these options decodes greedily."""

    samples: int = 1  # responses per prompt
    temperature: float = 0.0  # 0: greedy (argmax), and then one response is all the samples
    top_p: float = 1.0

    @staticmethod
    def of(pipe: PipelinePlan) -> "EvalSampling":
        options = pipe.datasets[0].options
        return EvalSampling(int(options.get("eval_samples") or 1), float(options.get("eval_temperature") or 0.0),
                            float(options.get("eval_top_p") or 1.0))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def score(responses: list[list[str]], prompts: list, metric: "EvalMetric | None" = None) -> dict:
    """``accuracy``: the metric (exact match by default) averaged over every
    response; ``pass_at_k``: the share of prompts with at least one response
    scoring full marks (1 or more) among its k; ``failed``: responses the
    metric could not score (counted as 0)."""
    from rldsl.rewards import exact_match

    if metric is not None:  # the run's own: every response at once, in its killable processes
        scored = metric.score_groups(responses, prompts)
    else:
        scored = [[(exact_match(r, p.answer, p.text), None) for r in group] for group, p in zip(responses, prompts)]
    return summarize(scored)


def summarize(scored: list[list[tuple[float | None, str | None]]]) -> dict:
    """``score``'s figures from each prompt's ``(value, None)`` or ``(None, why)``."""
    rewards = [[value or 0.0 for value, _ in group] for group in scored]
    total = sum(len(group) for group in rewards)
    out = {"accuracy": sum(map(sum, rewards)) / max(total, 1),
           "pass_at_k": sum(any(r >= 1.0 for r in group) for group in rewards) / max(len(rewards), 1)}
    failed = sum(reason is not None for group in scored for _, reason in group)
    return {**out, "failed": failed} if failed else out


def metric_functions(pipe: PipelinePlan) -> tuple[str, list[str]]:
    """The dataset's `eval_metric`, by name, and the functions it sums."""
    named = pipe.datasets[0].options.get("eval_metric") or "reward"
    if named != "reward":
        return named.partition("@")[0], [named]
    rewards = [s.settings["fn"] for s in pipe.stages if s.kind == "reward"]
    return "reward", rewards or ["rldsl.rewards:exact_match"]


def evaluates_episodes(pipe: PipelinePlan) -> bool:
    """Whether the evaluation metric is the episode's reward (episode_evaluation.py)."""
    return _are_episode_rewards(metric_functions(pipe)[1])


def _are_episode_rewards(specs: list[str]) -> bool:
    from rldsl.runtime.environments import reads_episode_reward

    return all(reads_episode_reward(spec) for spec in specs)


class EvalMetric:
    """The dataset's `eval_metric`: the pipeline's reward functions (summed)
    or one `module:function`, each bounded by the reward stage's timeout; a
    response the metric cannot score counts 0 and is reported as failed.

    The functions run in reward processes (reward_pool.py), as the reward
    stage's do: one that hangs is killed at the timeout and replaced, never
    left spinning in a thread nobody can stop."""

    PROCESSES = 2  # per function: a hung response holds one, the other goes on

    def __init__(self, pipe: PipelinePlan):
        from rldsl.runtime.reward_pool import RewardPool

        self.name, self.specs = metric_functions(pipe)
        self.episodes = _are_episode_rewards(self.specs)  # scored by playing episodes, not by a function (no pools)
        if self.episodes:
            self.name, self.specs = "episode_reward", []
        rewards = [s for s in pipe.stages if s.kind == "reward"]
        self.timeout_s = float(rewards[0].settings.get("timeout", 10.0)) if rewards else 10.0
        straggler = float(rewards[0].settings.get("straggler", 0.0)) if rewards else 0.0
        self.pools = [RewardPool(spec, self.PROCESSES, self.timeout_s, straggler) for spec in self.specs]
        for pool in self.pools:
            pool.wait_ready()  # a function that does not import fails here, as before

    def score_groups(self, responses: list[list[str]], prompts: list) -> list[list[tuple[float | None, str | None]]]:
        """Per prompt, ``(value, None)`` or ``(None, why)`` for each of its responses."""
        from rldsl.runtime.protocols import RewardFailure

        samples = [(r, p.answer, p.text) for group, p in zip(responses, prompts) for r in group]
        totals: list[tuple[float | None, str | None]] = [(0.0, None)] * len(samples)
        for pool in self.pools:
            for index, result in enumerate(pool.score(samples)):
                value, reason = totals[index]
                if reason is None:
                    totals[index] = ((None, result.detail or result.reason) if isinstance(result, RewardFailure)
                                     else (value + float(result), None))
        scored, start = [], 0
        for group in responses:
            scored.append(totals[start:start + len(group)])
            start += len(group)
        return scored

    def close(self) -> None:
        for pool in self.pools:
            pool.close()


class Evaluator:
    """A weight receiver that answers ``evaluate`` requests. Run it as a
    threaded Ray actor (``max_concurrency`` above the evaluations that can be
    waiting at once) so pushes land while evaluations wait or decode."""

    def __init__(self, pipe: PipelinePlan, background: bool = True):
        from rldsl.runtime.engines.factory import load_policy
        from rldsl.runtime.engines.torch.generate import TorchGenerator
        from rldsl.runtime.ray_lowering.actor_process import setup_worker_process
        from rldsl.runtime.ray_lowering.trace import Tracer

        setup_worker_process()
        self.tracer = Tracer("evaluator", "evaluator", "evaluator")
        if background:  # on a busy machine the stages get the CPU first
            os.nice(_NICENESS)
        train = pipe.stage(pipe.batch.train_stage)
        generate = next(s for s in pipe.stages if s.kind == "generate")
        model = next(m for m in pipe.models if m.name == train.model)
        self.sampling, self.seed = EvalSampling.of(pipe), pipe.run.seed
        self.decoder = TorchGenerator(load_policy(model, pipe, pipe.run.seed),
                                      max_new_tokens=generate.settings["max_new_tokens"],
                                      temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                      stop_token_ids=tuple(generate.settings.get("stop_token_ids", ())))
        self.prompts = held_out_prompts(pipe)
        self.metric = EvalMetric(pipe)
        self.episodes = EpisodeEvaluation(pipe, self.decoder) if self.metric.episodes else None
        self._lock = threading.Lock()  # guards the two fields below
        self._incoming: tuple[int, dict] | None = None  # a push in progress
        self._latest: tuple[int, dict] | None = None  # the newest complete push
        self._evaluating = threading.Lock()  # one evaluation at a time

    def ready(self) -> bool:
        return True

    def trace(self) -> dict:
        return self.tracer.drain()

    def update_weights(self, bucket: dict, version: int, last: bool) -> None:
        with self._lock:
            if self._incoming is None or self._incoming[0] != version:
                self._incoming = (version, {})
            self._incoming[1].update(bucket)
            if last:
                self._latest, self._incoming = self._incoming, None

    def version(self) -> int:
        with self._lock:
            return self._latest[0] if self._latest else self.decoder.version

    def evaluate(self, min_version: int = 0, timeout_s: float = 600.0) -> dict:
        """Exact-match accuracy of the newest weights, once a version of at
        least ``min_version`` has arrived (or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        while self.version() < min_version and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._evaluating, self.tracer.span("evaluation", min_version=min_version) as args:
            with self._lock:
                latest, self._latest = self._latest, None
            if latest is not None:
                self.decoder.update_weights(latest[1], latest[0], last=True)
            scores = self.episode_scores() if self.episodes else score(self.responses(), self.prompts, self.metric)
            args.update(version=self.decoder.version, **scores)
        return {**scores, "metric": self.metric.name, "version": self.decoder.version, "prompts": len(self.prompts),
                "samples": 1 if self.sampling.greedy else self.sampling.samples}

    def responses(self) -> list[list[str]]:
        """Each prompt's responses under the loaded weights: one argmax decode
        when greedy (more samples would repeat it), else ``samples`` draws
        seeded by the run's seed and the weight version."""
        if self.sampling.greedy:
            return [[text] for text in self.decoder.generate_greedy(self.prompts)]
        samples, responses = self.sampling.samples, []
        chunk = max(1, self.decoder.GREEDY_ROWS_PER_DECODE // samples)  # bounds the KV cache like greedy
        for start in range(0, len(self.prompts), chunk):
            prompts = self.prompts[start:start + chunk]
            batch = self.decoder.generate(prompts, samples, seed=self._chunk_seed(start))
            texts = self.decoder.decode(batch)
            responses += [texts[i * samples:(i + 1) * samples] for i in range(len(prompts))]
        return responses

    def episode_scores(self) -> dict:
        """The figures of ``score`` over episodes, with their mean statistics."""
        samples = 1 if self.sampling.greedy else self.sampling.samples
        scored, stats = self.episodes.play(self.prompts, samples, self._chunk_seed)
        return {**summarize(scored), **stats}

    def _chunk_seed(self, start: int) -> int:
        return eval_seed(self.seed, self.decoder.version, start)


def eval_seed(run_seed: int, version: int, start: int) -> int:
    """The seed of the sampled responses of the prompts from ``start`` on:
    the same weights always score the same, wherever they are decoded."""
    return random.Random(f"eval-{run_seed}-{version}-{start}").getrandbits(62)


class EvaluationSchedule:
    """The driver's side: which steps to evaluate, the requests in flight
    (answered in order), the results so far and the evaluations that timed
    out. ``at_start`` / ``at_end`` (``run { eval_at_start  eval_at_end }``):
    whether the starting weights and the last step's are evaluated besides
    the ``every`` grid. ``timeout_s`` (``run { eval_timeout }``, 0: none)
    bounds each evaluation from its request: one not answered by then is
    reported as timed out and no longer waited for, so the end of a run
    never hangs on it (the evaluator goes on; a later request waits behind
    it)."""

    def __init__(self, actor, every: int, total_steps: int, previous: list[dict] | None = None,
                 timeout_s: float = 0.0, clock=time.monotonic, at_start: bool = True, at_end: bool = True):
        self.actor, self.every, self.total_steps = actor, every, total_steps
        self.at_start, self.at_end = at_start, at_end
        self.timeout_s, self.clock = timeout_s, clock
        self.pending: list[tuple[int, int, object, float]] = []  # (step, min version, ObjectRef, asked at)
        self.done: list[dict] = list(previous or [])
        self.timed_out: list[dict] = []  # {"step", "version", "timeout_s"}: asked for, never answered in time
        self.failed: list[dict] = []  # {"step", "version", "error"}: the evaluation raised
        self.lost: str | None = None  # why the evaluator is gone: it died and no replacement took over yet
        self._unanswered: list[tuple[int, int]] = []  # requests its death left, for a replacement

    def due(self, step: int) -> bool:
        """Every ``eval_every`` steps; the start and the last step are asked for separately."""
        return bool(self.every) and step % self.every == 0 and step < self.total_steps

    def due_at_end(self, step: int) -> bool:
        """The last step: with ``at_end``, or where the ``every`` grid falls on it anyway."""
        return self.at_end or (bool(self.every) and step % self.every == 0)

    def request(self, step: int, version: int) -> None:
        if self.lost is None:
            self.pending.append((step, version, self.actor.evaluate.remote(min_version=version), self.clock()))
        else:
            self._unanswered.append((step, version))

    def adopt(self, actor) -> None:
        """A replacement evaluator: it answers what its predecessor left."""
        self.actor, self.lost = actor, None
        unanswered, self._unanswered = self._unanswered, []
        for step, version in unanswered:
            self.request(step, version)

    def collect(self, wait: bool = False) -> tuple[list[dict], list[dict]]:
        """Results that are in (with ``wait``: all of them, each waited for
        until its deadline), oldest first, and the evaluations that timed
        out meanwhile."""
        import ray

        finished, expired = [], []
        while self.pending:
            step, version, ref, asked_at = self.pending[0]
            if not ray.wait([ref], timeout=self._wait_s(asked_at, wait))[0]:
                if not (wait or self._overdue(asked_at)):  # waited for until its deadline: overdue now
                    break
                self.pending.pop(0)
                expired.append({"step": step, "version": version, "timeout_s": self.timeout_s})
                continue
            self.pending.pop(0)
            try:
                answer = {"step": step, **ray.get(ref)}
            except ray.exceptions.RayActorError as error:
                if self._actor_died(step, version, ref, error, expired):
                    break
                continue
            except ray.exceptions.RayError as error:  # the evaluation raised: reported, the run goes on
                self._failure(step, version, error, expired)
                continue
            if answer.pop("timed_out", False):  # it stopped itself at the deadline (on the generators)
                expired.append({"step": step, "version": answer.get("version", version),
                                "timeout_s": self.timeout_s})
            else:
                finished.append(answer)
        self.done += finished
        self.timed_out += [entry for entry in expired if "error" not in entry]
        return finished, expired

    def finish_within(self, seconds: float) -> tuple[list[dict], list[dict]]:
        """At a stop: the evaluations in flight that answer within ``seconds``
        (all together), and the ones left, ``{"step", "version"}``: skipped."""
        import ray

        deadline, finished = self.clock() + seconds, []
        while self.pending:
            step, version, ref, _ = self.pending[0]
            if not ray.wait([ref], timeout=max(0.0, deadline - self.clock()))[0]:
                break
            self.pending.pop(0)
            try:
                answer = {"step": step, **ray.get(ref)}
            except ray.exceptions.RayError as error:
                self._failure(step, version, error, [])
                continue
            if not answer.pop("timed_out", False):
                finished.append(answer)
        skipped = [{"step": s, "version": v} for s, v, _, _ in self.pending] + \
                  [{"step": s, "version": v} for s, v in self._unanswered]
        self.pending, self._unanswered = [], []
        self.done += finished
        return finished, skipped

    def _actor_died(self, step: int, version: int, ref, error: BaseException, expired: list[dict]) -> bool:
        """The evaluator died: the driver replaces it, training goes on; its
        requests wait for the replacement. True: stop collecting."""
        self.lost = _one_line(error)
        self._unanswered += [(step, version)] + [(s, v) for s, v, _, _ in self.pending]
        self.pending = []
        return True

    def _failure(self, step: int, version: int, error: BaseException, expired: list[dict]) -> None:
        entry = {"step": step, "version": version, "error": _one_line(error)}
        self.failed.append(entry)
        expired.append(entry)

    def _wait_s(self, asked_at: float, wait: bool) -> float | None:
        """How long to wait for one answer now: not at all while polling,
        else until its deadline (None: for ever, without a timeout)."""
        if not wait:
            return 0
        return max(0.0, asked_at + self.timeout_s - self.clock()) if self.timeout_s else None

    def _overdue(self, asked_at: float) -> bool:
        return bool(self.timeout_s) and self.clock() - asked_at >= self.timeout_s


def _one_line(error: BaseException) -> str:
    cause = getattr(error, "cause", None) or error
    lines = [line for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}"


def describe_timeout(entry: dict) -> str:
    """The line a timed-out (or failed) evaluation gets."""
    if "error" in entry:
        return f"eval @ step {entry['step']}: failed ({entry['error']}); no score for these weights"
    return (f"eval @ step {entry['step']}: timed out after {entry['timeout_s']:g}s (run {{ eval_timeout }}); "
            "no score for these weights")


def evaluation_summary(evals: list[dict], last_step: int) -> dict:
    """summary.json's evaluations: every one, and ``eval_start`` / ``eval_end``
    only where the starting weights and the last step's were evaluated, so
    a run that skipped either reports no change it did not measure."""
    if not evals:
        return {}
    summary = {"evals": evals}
    if evals[0]["step"] == 0:
        summary["eval_start"] = evals[0]["accuracy"]
    if evals[-1]["step"] == last_step:
        summary["eval_end"] = evals[-1]["accuracy"]
    return summary


def accuracy_change(evals: list[dict], last_step: int) -> str | None:
    """The final table's held-out accuracy: start -> end when both were
    evaluated, else each number with the step it was measured at."""
    if not evals:
        return None
    first, last = evals[0], evals[-1]
    if len(evals) == 1:
        return f"{first['accuracy']:.3f} at step {first['step']} (the only evaluation)"
    change = f"{last['accuracy'] - first['accuracy']:+.3f}"
    if first["step"] == 0 and last["step"] == last_step:
        return f"{first['accuracy']:.3f} -> {last['accuracy']:.3f} ({change})"
    return f"{first['accuracy']:.3f} (step {first['step']}) -> {last['accuracy']:.3f} (step {last['step']}), {change}"
