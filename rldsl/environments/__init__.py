"""Builtin multi-turn environments, and the reward that reads an episode's.

An environment is a class with ``reset(prompt, answer) -> messages`` and
``step(messages, completion) -> (observation, reward, done)``
(``rldsl.runtime.environments.protocol``); a pipeline names one in an
``environment`` block and a generate stage runs each sample as an episode
in it. No torch here: `rldsl check` looks these classes up.
"""

from __future__ import annotations

from rldsl.environments.arith import ArithAnswer, ArithRetry
from rldsl.environments.tools import calculate

ENVIRONMENTS = ("ArithRetry", "ArithAnswer")
TOOLS = ("calculate",)
__all__ = ["ENVIRONMENTS", "TOOLS", "ArithAnswer", "ArithRetry", "calculate", "episode_reward"]


def episode_reward(response: str, answer: str, prompt: str = "") -> float:
    """The reward stage of a generate stage with an environment names this:
    a reward worker then reads each sample's summed episode reward (the
    ``episode_reward`` field) instead of calling a function on its text, and
    drops a sample whose episode failed. There is no reward to compute from
    the text alone, so a direct call is refused."""
    raise TypeError("rldsl.environments:episode_reward is the reward an environment gave its episode; it is read "
                    "from the episode, not computed from a response (use it as a reward stage's `fn` after a "
                    "generate stage with an `environment`)")
