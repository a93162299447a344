"""Held-out evaluation in the environment: each prompt played as an episode.

A pipeline whose samples are episodes and whose evaluation metric is the
episode's reward (``eval_metric = "rldsl.environments:episode_reward"``, or
the default ``reward`` when its reward stage reads the episode's) scores
the whole episode, not a first turn: on the evaluator, each held-out prompt
is played in the generate stage's environment (its tools, turns and token
budgets) by the evaluator's copy of the policy, greedily by default, and
the episode's reward is the score. An episode that fails (its environment
raised, hung or died) counts 0 and is reported as failed, as a metric that
raises is. Each result also carries the mean turns and, with tools, the
mean tool calls and tool errors per episode.

The episodes run as the generators' do (``EpisodeRunner``), over a
continuous batcher of the evaluator's own engine, so their turns decode
together.
"""

from __future__ import annotations

from rldsl.plan import PipelinePlan
from rldsl.runtime.environments import DROP_REASONS, EpisodeStatus, episode_runner

EPISODES_PER_CHUNK = 32  # episodes played at once (a thread and an environment process each)


class EpisodeEvaluation:
    """Plays evaluation prompts on ``engine`` (a generator whose sampling
    is the evaluation's) in the pipeline's first generate stage's environment."""

    def __init__(self, pipe: PipelinePlan, engine):
        from rldsl.runtime.engines.batching import ContinuousBatcher

        stage = next(s for s in pipe.stages if s.kind == "generate" and s.settings.get("environment"))
        self.batcher = ContinuousBatcher(engine)
        self.runner = episode_runner(pipe, stage, self.batcher, engine.tokenizer)

    def play(self, prompts: list, samples: int, seed_of) -> tuple[list[list[tuple[float | None, str | None]]], dict]:
        """Per prompt, ``(reward, None)`` or ``(None, why)`` for each of its
        ``samples`` episodes (``seed_of(start)``: the seed of the chunk from
        ``start``), and the episodes' mean statistics."""
        from rldsl.runtime import protocols as p

        scored, totals, count = [], {"turns": 0.0, "tool_calls": 0.0, "tool_errors": 0.0}, 0
        chunk = max(1, EPISODES_PER_CHUNK // samples)
        for start in range(0, len(prompts), chunk):
            batch, _ = self.runner.run(prompts[start:start + chunk], samples, seed_of(start))
            rewards, statuses = batch[p.FIELD_EPISODE_REWARD].tolist(), batch[p.FIELD_EPISODE_STATUS].tolist()
            results = [(reward, None) if status == EpisodeStatus.OK else (None, DROP_REASONS[EpisodeStatus(status)])
                       for reward, status in zip(rewards, statuses)]
            scored += [results[i * samples:(i + 1) * samples] for i in range(len(results) // samples)]
            for name, field in (("turns", p.FIELD_TURNS), ("tool_calls", p.FIELD_TOOL_CALLS),
                                ("tool_errors", p.FIELD_TOOL_ERRORS)):
                totals[name] += float(batch[field].sum())
            count += len(results)
        tools = self.runner.tool_format is not None
        stats = {name: round(total / max(count, 1), 4) for name, total in totals.items()
                 if tools or name == "turns"}
        return scored, stats

    def close(self) -> None:
        """The environment's processes (and a harness's endpoint), then the batcher."""
        self.runner.host.close()
        closing = getattr(self.runner, "close", None)
        if closing is not None:
            closing()
        self.batcher.close()
