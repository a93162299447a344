"""A reward stage with a reward model: ``JudgeWorker`` (one per rank, the
model loaded by its engine, rldsl.runtime.engines.judge) and the scoring
rules it follows, ``JudgeScoring`` (no Ray here, tested on its own).

The model's value is a component named after the stage, weighted by the
stage's `weight`; the stage's `fn` components, if any, are scored in the
worker's reward processes meanwhile and added (``ComponentReward``, each
part logged as ``reward/<name>``). The stage's `timeout` bounds each
forward of `micro_batch` rows: one that overruns drops those samples as
``reward_timeout`` and the next one starts (Python cannot stop the thread,
which is left to finish on its own: inference needs no lock). A judge that raises drops its rows as
``reward_raised``; a parser that cannot read its answer drops the sample
as ``reward_invalid``, with the judge's text.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from rldsl.rewards import checked_reward, load_reward
from rldsl.runtime.control.ledger import REWARD_INVALID, REWARD_RAISED, REWARD_TIMEOUT
from rldsl.runtime.protocols import ComponentReward, RewardFailure
from rldsl.runtime.ray_lowering.workers import RewardWorker, StageWorker, policy_tokenizer
from rldsl.runtime.ray_lowering.trace import prompt_groups

Sample = tuple[str, str, str]  # (response, answer, prompt)


class JudgeScoring:
    """The reward model's component of each sample: ``judge`` is a
    ``ScoreJudge`` (``score(pairs)``) or a generating judge (``answer(texts)``)."""

    def __init__(self, judge, name: str, weight: float = 1.0, timeout_s: float | None = None,
                 micro_batch: int = 8, template: Callable | None = None, parse: Callable | None = None,
                 parse_name: str = "parse"):
        self.judge, self.name, self.weight = judge, name, weight
        self.timeout_s = timeout_s or None
        self.micro_batch = max(1, micro_batch)
        self.template, self.parse, self.parse_name = template, parse, parse_name

    def values(self, samples: Sequence[Sample]) -> list[float | RewardFailure]:
        """The model's value (unweighted) of each sample, or why it has none."""
        out: list[float | RewardFailure] = []
        for start in range(0, len(samples), self.micro_batch):
            out += self._chunk(list(samples[start:start + self.micro_batch]))
        return out

    def _chunk(self, samples: list[Sample]) -> list[float | RewardFailure]:
        if self.template is None:
            scores = self._bounded(self.judge.score, [(prompt, response) for response, _, prompt in samples])
            if isinstance(scores, RewardFailure):
                return [scores] * len(samples)
            return [self._number(value, None) for value in scores]
        texts, failed = [], {}
        for row, (response, answer, prompt) in enumerate(samples):
            try:
                texts.append(str(self.template(prompt, response, answer)))
            except Exception as error:  # noqa: BLE001 - a template failing on one sample drops that sample
                failed[row] = RewardFailure(REWARD_RAISED, f"the judge template raised {type(error).__name__}: "
                                                           f"{error}")
        answers = self._bounded(self.judge.answer, texts) if texts else []
        if isinstance(answers, RewardFailure):
            return [failed.get(row, answers) for row in range(len(samples))]
        answered = iter(answers)
        return [failed[row] if row in failed else self._parsed(next(answered)) for row in range(len(samples))]

    def _parsed(self, text: str) -> float | RewardFailure:
        try:
            value = self.parse(text)
        except Exception as error:  # noqa: BLE001 - an unreadable answer drops its sample only
            return RewardFailure(REWARD_INVALID, f"{self.parse_name} could not read the judge's answer {text!r}: "
                                                 f"{error}")
        return self._number(value, text)

    def _number(self, value, text: str | None) -> float | RewardFailure:
        number, problem = checked_reward(value)
        if problem:
            said = f" (the judge answered {text!r})" if text is not None else ""
            return RewardFailure(REWARD_INVALID, f"reward model {self.name}: {problem}{said}")
        return number

    def _bounded(self, call: Callable, rows: list):
        """``call(rows)`` within the timeout, else a failure for all of them."""
        result: list = []

        def run() -> None:
            try:
                result.append(call(rows))
            except Exception as error:  # noqa: BLE001 - any failure drops these rows only
                result.append(RewardFailure(REWARD_RAISED, f"reward model {self.name} raised "
                                                           f"{type(error).__name__}: {error}"))

        worker = threading.Thread(target=run, daemon=True, name=f"judge-{self.name}")
        worker.start()
        worker.join(self.timeout_s)
        if not result:
            return RewardFailure(REWARD_TIMEOUT, f"reward model {self.name}: no answer for {len(rows)} rows within "
                                                 f"the {self.timeout_s:g}s timeout")
        return result[0]

    def combine(self, values: Sequence, functions: Sequence | None, function_name: str | None = None) -> list:
        """Each sample's reward: the model's weighted value plus the `fn`
        rewards (their parts, or one part named ``function_name``)."""
        out = []
        for row, value in enumerate(values):
            other = functions[row] if functions is not None else 0.0
            if isinstance(value, RewardFailure) or isinstance(other, RewardFailure):
                out.append(value if isinstance(value, RewardFailure) else other)
                continue
            parts = {self.name: value}
            if functions is not None:
                parts.update(getattr(other, "parts", None) or {function_name or "fn": float(other)})
            out.append(ComponentReward(self.weight * value + float(other), parts))
        return out


class JudgeWorker(RewardWorker):
    """One rank of a reward stage with a reward model, on its GPUs (or the CPU)."""

    def __init__(self, pipe, stage, rank, dataplane_spec):
        from rldsl.runtime.engines.factory import build_judge
        from rldsl.runtime.reward_pool import DEFAULT_PROCESSES, RewardPool

        StageWorker.__init__(self, pipe, stage, rank, dataplane_spec)
        settings = stage.settings
        self.reads_episodes = False
        fn = settings.get("fn")
        self.pool = RewardPool(fn, settings.get("processes", DEFAULT_PROCESSES), settings.get("timeout"),
                               settings.get("straggler", 0.0)) if fn else None
        self.function_name = fn.partition("@")[0].partition(":")[2] if isinstance(fn, str) else None
        self.tokenizer = policy_tokenizer(pipe)
        self.scoring = judge_scoring(stage, build_judge(stage, pipe, seed=pipe.run.seed + 3000 + rank))
        self._functions = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-fn")

    def reward(self, keys: Sequence[str]) -> list:
        with self.tracer.span("reward", groups=prompt_groups(keys), model=self.stage.model):
            samples = self._samples(keys)
            functions = self._functions.submit(self.pool.score, samples) if self.pool is not None else None
            values = self.scoring.values(samples)
            results = self.scoring.combine(values, functions.result() if functions else None, self.function_name)
            self._log_failures(keys, results)
            return results


def judge_scoring(stage, judge) -> JudgeScoring:
    """The stage plan's settings: `weight`, `timeout`, `micro_batch`, and a
    generating judge's `template` and `parse` (imported here: a module
    that does not import fails the worker at start)."""
    settings = stage.settings
    generates = settings.get("judge") == "generate"
    return JudgeScoring(judge, stage.name, float(settings.get("weight", 1.0)), settings.get("timeout"),
                        int(settings.get("micro_batch", 8)),
                        load_reward(settings["template"]) if generates else None,
                        load_reward(settings["parse"]) if generates else None,
                        settings.get("parse", "parse").partition("@")[0])
