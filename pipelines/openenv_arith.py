"""An OpenEnv environment (openenv-core's API, nothing of rldsl's): arithmetic
with a second chance. `pipelines/multiturn_openenv.rlp` trains on it.

Reset with a dataset prompt (``"12+19="``) it asks that; with only a seed it
draws its own question. A wrong answer hears " up" or " down" and the
question again; the reward halves with each turn taken.
"""

import random
from typing import Optional
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class ArithAction(Action):
    message: str = Field(..., description="the model's answer")


class ArithObservation(Observation):
    text: str = Field(default="", description="what the model reads next")


class ArithEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.question, self.answer = "", ""

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, prompt: Optional[str] = None,
              answer: Optional[str] = None) -> ArithObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        if prompt and answer:
            self.question, self.answer = prompt, answer.strip()
        else:
            rng = random.Random(seed)
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            self.question, self.answer = f"{a}+{b}=", str(a + b)
        return ArithObservation(text=self.question, done=False, reward=0.0)

    def step(self, action: ArithAction) -> ArithObservation:
        self._state.step_count += 1
        guess = action.message.strip()
        if guess == self.answer:
            return ArithObservation(text="", done=True, reward=0.5 ** (self._state.step_count - 1))
        hint = ("up" if int(guess) < int(self.answer) else "down") if guess.isdigit() else "no"
        return ArithObservation(text=f" {hint} {self.question}", done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state
