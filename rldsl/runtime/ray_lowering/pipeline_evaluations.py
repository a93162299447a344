"""Held-out evaluation, as one pipeline's driver follows it: the evaluator
actor (or the generator replicas, `eval_on = generators`) made, replaced
when it dies, and its results shown and recorded.

Mixed into ``PipelineDriver`` (pipeline_driver.py), whose attributes it
reads: ``pipe``, ``handles``, ``settings``, ``controller``, ``progress``,
``traces``, ``prefix`` and ``say``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rldsl.runtime.ray_lowering.cluster import ACTOR_NUM_CPUS
from rldsl.runtime.ray_lowering.supervision import root_cause


class PipelineEvaluations:
    """The evaluation half of ``PipelineDriver`` (which sets ``evaluations``
    and ``_evaluator_given_up``)."""

    def _create_evaluator(self) -> None:
        """The held-out evaluator: one more weight receiver, on the CPU."""
        from rldsl.runtime.ray_lowering.evaluation import EvaluationSchedule

        if not self.pipe.evaluates:
            return
        if not self.pipe.has_evaluator:  # eval_on = generators: the generator replicas decode it
            from rldsl.runtime.ray_lowering.generator_evaluation import generator_schedule

            self.evaluations = generator_schedule(self.pipe, self.handles, self.settings.steps, self.previous_evals)
            return
        run = self.pipe.run
        self.evaluations = EvaluationSchedule(self._evaluator_actor(), run.eval_every, self.settings.steps,
                                              self.previous_evals, timeout_s=run.eval_timeout_s,
                                              at_start=run.eval_at_start, at_end=run.eval_at_end)

    def _evaluator_actor(self, suffix: str = ""):
        from rldsl.runtime.ray_lowering.actor_process import run_actor
        from rldsl.runtime.ray_lowering.evaluation import Evaluator

        # threads to spare: evaluations waiting for a version must never starve the push that brings it
        return run_actor(Evaluator).options(num_cpus=ACTOR_NUM_CPUS, max_concurrency=4,
                                             name=f"{self.prefix}evaluator{suffix}").remote(self.pipe)

    def _replace_evaluator(self) -> None:
        """A new evaluator, handed the newest weights by the controller, takes
        over the evaluations its predecessor left; if none starts, evaluation
        stops and the run goes on."""
        import ray

        cause, started = self.evaluations.lost, time.monotonic()
        try:
            actor = self._evaluator_actor(f"~{len(self.evaluations.done) + 1}")
            ray.get(actor.ready.remote(), timeout=300)
            ray.get(self.controller.adopt_observer.remote(actor), timeout=60)
        except Exception as error:  # noqa: BLE001 - any failure to rebuild ends evaluation only
            self._evaluator_given_up = True
            self.say(f"held-out evaluation stopped: the evaluator died ({cause}) and no replacement started "
                     f"({root_cause(error)}); the run goes on")
            return
        self.evaluations.adopt(actor)
        self.traces.replace(f"{self.prefix}evaluator", actor)
        self.say(f"recovered: the evaluator died ({cause}); a new one took its place in "
                 f"{time.monotonic() - started:.1f}s and the evaluations it held were asked again")

    def _observers(self) -> list:
        """Weight receivers outside the sync edges: the evaluator."""
        return [self.evaluations.actor] if self._has_evaluator_actor() else []

    def _has_evaluator_actor(self) -> bool:
        return bool(self.evaluations) and self.evaluations.actor is not None

    def finish_evaluations(self, timeout_s: float) -> dict:
        """At a stop: the evaluations in flight, finished within ``timeout_s``
        and shown; those still running are said and recorded as skipped.
        Returns ``{"done", "skipped"}`` for summary.json."""
        if not self.evaluations:
            return {}
        finished, skipped = self.evaluations.finish_within(timeout_s)
        for result in finished:
            self._show_result(result, said=True)
        for entry in skipped:
            self.say(f"eval @ step {entry['step']} (weights v{entry['version']}) was still running at the stop: "
                     f"skipped (a resume from a checkpoint of version {entry['version']} evaluates it first)")
        return {"done": self.evaluations.done, "skipped": skipped}

    def redo_skipped_evaluations(self, version: int) -> None:
        """A resume: the evaluations the stop skipped at the weights it resumes from, asked first."""
        path = self.run_dir / "summary.json"
        try:
            skipped = json.loads(path.read_text()).get("eval_skipped", [])
        except (OSError, ValueError):
            return
        for entry in skipped:
            if entry.get("version") == version:
                self.evaluations.request(step=entry["step"], version=version)

    def _show_result(self, result: dict, said: bool) -> None:
        self.progress.eval(result["step"], result["accuracy"], version=result["version"],
                           on=result.get("on", "evaluator"))
        text = (f"eval @ step {result['step']}: held-out accuracy {result['accuracy']:.3f} "
                f"({result['prompts']} prompts, weights v{result['version']}"
                + (f" on generator replica {result['replica']})" if "replica" in result else ")"))
        if said:
            self.say(text)
        else:
            self.progress.note(text)

    def _show_evaluations(self, wait: bool = False) -> None:
        from rldsl.runtime.ray_lowering.evaluation import describe_timeout

        results, expired = self.evaluations.collect(wait)
        if self.evaluations.lost and not self._evaluator_given_up:
            self._replace_evaluator()
            if wait and not self.evaluations.lost:
                more, late = self.evaluations.collect(wait)
                results, expired = results + more, expired + late
        for entry in expired:
            self.say(describe_timeout(entry))
        for result in results:
            self._show_result(result, said=result["step"] == 0 or wait)


def previous_evals(run_dir: Path) -> list[dict]:
    """The evaluations a resumed run already made (metrics.jsonl), so that the schedule goes on after them."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a torn line (the process died mid-write): the rewind drops it
            continue
    return [{"step": r["step"], "accuracy": r["accuracy"]} for r in records if r.get("eval")]
