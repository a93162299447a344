"""``builtin:tiny-agent``'s warm start: a builtin task through the calculator.

The agent writes the task's question as a native tool call in the
``pythonic`` format, reads the builtin calculator's answer
(``rldsl.environments:calculate``) and gives it: the episode, as the
episode loop joins it for a model without a chat template, is

    12+19=  [calculate(expression='12+19')]<eos>  31  31<eos>

(the prompt, the model's call and its end of turn, the tool's result,
which is context and not imitated, then the model's answer).

It starts from tiny-lm's warm start on the task (cached, shared with the
pipelines that train tiny-lm: its careless habit included), its weights
copied into the agent's larger embeddings (the tool characters' rows and
the positions past 64 keep their initialisation), then imitates a teacher
that answers at once, carelessly, ``mistake_rate`` of the time and plays a
tool episode otherwise, until the greedy call, once begun, is right and
followed by the right answer on ``TOOL_ACCURACY`` of held-back train
prompts. Measured at seed 0 (800 steps, 26 s on 2 cores): calls begun are
right and answered right on 0.95 of held-out prompts, the first token opens
one with probability 0.20, and greedy episodes are right on 0.20 (mostly
answered at once, carelessly): a policy that RL with a verifiable reward
measurably improves by calling the tool more (``pipelines/multiturn_tools.rlp``).
(Imitating only tool episodes first, then the habit, wore the direct
answers down to one repeated number.)
"""

from __future__ import annotations

import torch

from rldsl.environments.tools import calculate
from rldsl.models import builtin_shape
from rldsl.models.base import BUILTIN_AGENT, CausalLM
from rldsl.runtime.engines.torch.warmstart import CARELESS_TEACHERS, WarmStartSettings, imitation, \
    load_warm_started
from rldsl.runtime.protocols import Prompt

TOOL_TASKS = ("builtin:arith",)  # the tasks whose questions are the calculator's expressions
CALL_TOKENS = 40  # a greedy first turn read by the check: the longest call and its end of turn fit
ANSWER_TOKENS = 8  # and the answer after the calculator's result
TOOL_ACCURACY = 0.9
# its checks play episodes, which take longer than 10 steps of training; 5e-3 reached TOOL_ACCURACY in 800
# steps, 3e-3 in 1100 (measured)
AGENT_SETTINGS = WarmStartSettings(check_every=100, lr=5e-3)


def load_warm_started_agent(task: str, seed: int = 0, settings: WarmStartSettings | None = None) -> CausalLM:
    """The warm-started ``builtin:tiny-agent``, trained now if the cache has none."""
    return load_warm_started(task, seed, builtin_shape(BUILTIN_AGENT), settings or AGENT_SETTINGS, BUILTIN_AGENT,
                             agent_warm_start)


def calculator_call(prompt: Prompt) -> str:
    """``"12+19="`` -> ``"[calculate(expression='12+19')]"``."""
    return f"[calculate(expression='{prompt.text.rstrip('=')}')]"


def tool_episode(prompt: Prompt) -> list[tuple[str | None, bool]]:
    """The call, the calculator's result (not imitated), the answer."""
    result = calculate(prompt.text.rstrip("="))
    return [(calculator_call(prompt), True), (None, True), (result, False), (result, True), (None, True)]


def agent_warm_start(model: CausalLM, task: str, seed: int, settings: WarmStartSettings) -> dict:
    if task not in TOOL_TASKS:
        raise ValueError(f"builtin:tiny-agent warm-starts on {', '.join(TOOL_TASKS)} (through the calculator), "
                         f"not {task}: use builtin:tiny-lm for it")
    base = load_warm_started(task, seed)
    _copy_weights(base, model)
    mistake = CARELESS_TEACHERS[task]

    def careless(prompt: Prompt, rng):
        return mistake(prompt) if rng.random() < settings.mistake_rate else tool_episode(prompt)

    report = imitation(model, task, seed, settings, [
        ("tools", careless, tool_accuracy, lambda acc: acc >= TOOL_ACCURACY, settings.max_learn_steps)])
    return {"tiny-lm": base.warm_start_report, **report}


def _copy_weights(source: CausalLM, target: CausalLM) -> None:
    """``source``'s weights into ``target``'s, whose embeddings may have more rows (appended ids, positions)."""
    theirs = source.module.state_dict()
    with torch.no_grad():
        for name, tensor in target.module.state_dict().items():
            tensor[: theirs[name].shape[0]].copy_(theirs[name])


def tool_accuracy(model: CausalLM, prompts: list[Prompt]) -> float:
    """The share of ``prompts`` whose greedy call, once begun (``[``), is right
    and followed by the right answer: whether the model can use the tool,
    whichever it would rather do."""
    from rldsl.runtime.engines.torch.generate import TorchGenerator

    opened = [continued(model, p, "[") for p in prompts]
    calls = TorchGenerator(model, max_new_tokens=CALL_TOKENS).generate_greedy(opened)
    right = [p for call, p in zip(calls, prompts) if "[" + call == calculator_call(p)]
    answered = [continued(model, p, calculator_call(p), p.answer) for p in right]
    answers = TorchGenerator(model, max_new_tokens=ANSWER_TOKENS).generate_greedy(answered) if right else []
    return sum(a == p.answer for a, p in zip(answers, right)) / max(len(prompts), 1)


def continued(model: CausalLM, prompt: Prompt, turn: str, result: str | None = None) -> Prompt:
    """``prompt`` followed by the model's ``turn`` (ended, when a ``result`` follows it)."""
    tokenizer = model.tokenizer
    ids = prompt.tokens(tokenizer) + tokenizer.encode(turn)
    if result is not None:
        ids += [tokenizer.eos_id] + tokenizer.encode(result)
    return Prompt(prompt.index, prompt.text, prompt.answer, prompt.meta, ids=tuple(ids))
