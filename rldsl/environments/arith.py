"""Arithmetic environments: ``ArithRetry`` (a second chance and a hint) and
``ArithAnswer`` (one answer, tools before it).

The model answers a prompt such as ``12+19=``; a wrong answer is told
`` up `` or `` down `` (or `` no `` for something that is not a number) and
the question asked again, up to the stage's turns: ``12+19=21 up 12+19=31``.
The reward halves with each turn taken (1, 0.5, 0.25, ...), so a policy
that is right the first time earns most. Every character is in the builtin
tiny model's vocabulary.
"""

from __future__ import annotations


class ArithRetry:
    def reset(self, prompt: str, answer: str) -> list[dict]:
        self.prompt, self.answer, self.turn = prompt, answer.strip(), 0
        return [{"role": "user", "content": prompt}]

    def step(self, messages: list[dict], completion: str) -> tuple[str, float, bool]:
        self.turn += 1
        guess = completion.strip()
        if guess == self.answer:
            return "", 0.5 ** (self.turn - 1), True
        hint = ("up" if int(guess) < int(self.answer) else "down") if guess.isdigit() else "no"
        return f" {hint} {self.prompt}", 0.0, False


class ArithAnswer:
    """One answer to a prompt such as ``12+19=``: reward 1 when it is right,
    else 0, and the episode ends. Tool turns before it (the calculator,
    offered by the pipeline's `tools`) cost nothing:
    ``12+19=[calculate(expression='12+19')]`` then the tool's ``31``, then
    the answer ``31``."""

    def reset(self, prompt: str, answer: str) -> list[dict]:
        self.answer = answer.strip()
        return [{"role": "user", "content": prompt}]

    def step(self, messages: list[dict], completion: str) -> tuple[str, float, bool]:
        return "", float(completion.strip() == self.answer), True
