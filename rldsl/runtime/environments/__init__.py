"""Multi-turn environments for generate stages (docs/runtime.md#environments).

``protocol``: what an environment is and what it may return; ``host``: the
processes its episodes run in; ``episodes``: the turn loop over a
generator's batcher; ``conversation``: the first turn's text and each
observation's tokens (token in, token out); ``tool_calls``: the model's
native tool calls; ``harness`` and ``endpoint``: agent harnesses through an
OpenAI-compatible endpoint; ``openenv_adapter`` and ``verifiers_adapter``:
OpenEnv environments and verifiers tasksets, run unchanged.
``episode_runner`` builds the loop a generate stage with an environment
uses (None without one).
"""

from __future__ import annotations

import math

from rldsl.runtime.environments.protocol import DROP_REASONS, Environment, EpisodeStatus

__all__ = ["DROP_REASONS", "Environment", "EpisodeStatus", "episode_fields", "episode_rewards", "episode_runner",
           "log_episode_failures", "reads_episode_reward"]


def episode_runner(pipe, stage, batcher, tokenizer):
    """The stage's ``EpisodeRunner``, or None when it has no environment."""
    name = stage.settings.get("environment")
    if not name:
        return None
    from rldsl.runtime.environments.conversation import conversation_turns
    from rldsl.runtime.environments.episodes import EpisodeRunner
    from rldsl.runtime.environments.host import EnvironmentHost

    if tokenizer is None:
        raise ValueError(f"generate stage `{stage.name}`: engine `{stage.engine.name}` has no tokenizer, and an "
                         f"environment (`{name}`) talks to the model in text; use a model's engine (torch, vllm, "
                         "sglang)")
    env = pipe.environment(name)
    model = next((m for m in pipe.models if m.name == stage.model), None)
    host = EnvironmentHost(env.fn, env.timeout_s or None, env.processes, env.tools, env.straggler)
    chat = model is not None and bool(model.chat_template)
    turns = conversation_turns(tokenizer, chat, host.tool_schemas if env.tool_format else None,
                               env.max_observation_tokens)
    if host.kind == "harness":  # an agent through the replica's OpenAI-compatible endpoint
        from rldsl.runtime.environments.harness import HarnessRunner

        return HarnessRunner(batcher, host, turns, tokenizer, env.max_turns, env.max_tokens, env.tool_format)
    return EpisodeRunner(batcher, host, turns, tokenizer, env.max_turns, env.max_tokens, env.tool_format)


def episode_fields(pipe) -> list[str]:
    """What a reward stage reads of episodes: their reward, status, turns,
    turn rewards and context ends, and their tool calls where an environment
    has tools."""
    from rldsl.runtime import protocols as p

    fields = [p.FIELD_EPISODE_REWARD, p.FIELD_EPISODE_STATUS, p.FIELD_TURNS, p.FIELD_TURN_REWARDS, p.FIELD_CONTEXT_FULL]
    if any(env.tool_format for env in pipe.environments):
        fields += [p.FIELD_TOOL_CALLS, p.FIELD_TOOL_ERRORS]
    return fields


def episode_rewards(fields: dict) -> list:
    """A reward stage's answers for episodes: each sample's summed reward
    with its statistics (the step's ``episode_stats``: turns, whether it
    ended at the model's context, the reward of each turn that got one, and
    tool calls when read), or the ``RewardFailure`` that drops a sample whose
    episode failed."""
    from rldsl.runtime import protocols as p

    columns = {name: fields[field].tolist() for name, field in (("turns", p.FIELD_TURNS),
                                                                ("context_ended", p.FIELD_CONTEXT_FULL),
                                                                ("tool_calls", p.FIELD_TOOL_CALLS),
                                                                ("tool_errors", p.FIELD_TOOL_ERRORS)) if field in fields}
    turn_rewards = fields[p.FIELD_TURN_REWARDS].tolist() if p.FIELD_TURN_REWARDS in fields else None
    results = []
    for row, (reward, status) in enumerate(zip(fields[p.FIELD_EPISODE_REWARD].tolist(),
                                               fields[p.FIELD_EPISODE_STATUS].tolist())):
        status = EpisodeStatus(int(status))
        turns = int(columns["turns"][row])
        stats = {name: float(values[row]) for name, values in columns.items()}
        if turn_rewards is not None:  # a turn without one (a tool call's, or never taken) is NaN: left out
            stats.update((f"reward_turn{k}", r) for k, r in enumerate(turn_rewards[row], 1) if not math.isnan(r))
        results.append(p.ComponentReward(float(reward), {}, stats)
                       if status == EpisodeStatus.OK else
                       p.RewardFailure(DROP_REASONS[status], f"its episode ended {status.name.lower()} after "
                                                             f"{turns} turns"))
    return results


def reads_episode_reward(fn) -> bool:
    """Whether a reward stage's `fn` is the episode's reward (the plan may
    have anchored it to the pipeline's directory with ``@DIR``)."""
    from rldsl.plan import EPISODE_REWARD_FN

    return isinstance(fn, str) and fn.partition("@")[0] == EPISODE_REWARD_FN


def log_episode_failures(failures: list, stage: str, keys) -> None:
    """One line for a group whose episodes failed: how many, and the first's reason."""
    if failures:
        import logging

        status, detail = failures[0]
        logging.getLogger(__name__).warning("generate %s: %d of %d episodes failed in %s; first: %s (%s)", stage,
                                            len(failures), len(keys), keys[0] if keys else "?", detail,
                                            DROP_REASONS[status])
