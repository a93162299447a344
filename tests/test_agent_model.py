"""builtin:tiny-agent: the builtin model that calls the calculator in its native
format, its warm start, and held-out evaluation that plays episodes.

Named to be collected early: its warm start is built here, on the worker of
the in-process tests, before the tool pipeline's run (tests/test_multiturn_tools_e2e.py)
loads it from the cache."""

from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_source
from rldsl.compiler.memory import BUILTIN_PARAMS, BUILTIN_SHAPES
from rldsl.launch_rules import BUILTIN_CONTEXTS
from rldsl.models import AGENT_SHAPE, BUILTIN_AGENT, builtin_tokenizer, load_model
from rldsl.models.tokenizer import AGENT_CHARACTERS, DEFAULT_CHARACTERS, CharTokenizer
from rldsl.runtime.environments.tool_calls import parse_tool_calls
from rldsl.runtime.protocols import Prompt

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = ROOT / "pipelines" / "multiturn_tools.rlp"


def greedy_episode_accuracy(model, prompts) -> float:
    """The tool pipeline's greedy episodes played here, apart from the runtime's
    episode loop (an oracle for it): a first turn that calls the calculator
    gets its result and answers in a second turn."""
    from rldsl.environments import calculate
    from rldsl.rewards import exact_match
    from rldsl.runtime.engines.torch.agent_warmstart import ANSWER_TOKENS, CALL_TOKENS, continued
    from rldsl.runtime.engines.torch.generate import TorchGenerator

    first = TorchGenerator(model, max_new_tokens=CALL_TOKENS).generate_greedy(prompts)
    followed = {}
    for index, (turn, prompt) in enumerate(zip(first, prompts)):
        calls = parse_tool_calls(turn, "pythonic").calls
        if len(calls) == 1 and calls[0].name == "calculate":
            try:
                result = calculate(**calls[0].arguments)
            except (TypeError, ValueError, SyntaxError) as error:
                result = f"error: {error}"
            then = continued(model, prompt, turn, result)
            if len(then.ids) + ANSWER_TOKENS <= model.config["max_positions"]:  # else no room to answer
                followed[index] = then
    answer = TorchGenerator(model, max_new_tokens=ANSWER_TOKENS).generate_greedy
    answers = dict(zip(followed, answer(list(followed.values())))) if followed else {}
    final = [answers.get(index, turn) for index, turn in enumerate(first)]
    return sum(exact_match(a, p.answer) for a, p in zip(final, prompts)) / max(len(prompts), 1)


def tools_plan(**replace):
    text = PIPELINE.read_text().replace("eval_size = 128", "eval_size = 32")
    for old, new in replace.items():
        text = text.replace(old, new)
    result = compile_source(text, str(PIPELINE))
    assert result.ok, result.diagnostics
    return result.plan.pipeline()


def test_the_agent_vocabulary_keeps_every_builtin_id_and_spells_a_call():
    agent, builtin = builtin_tokenizer(BUILTIN_AGENT), CharTokenizer()
    assert agent.characters.startswith(DEFAULT_CHARACTERS) and agent.characters == AGENT_CHARACTERS
    assert all(agent.encode(ch) == builtin.encode(ch) for ch in DEFAULT_CHARACTERS)
    call = "[calculate(expression='12+19')]"
    assert agent.unk_id not in agent.encode(call) and builtin.unk_id in builtin.encode(call)
    assert agent.decode(agent.encode(call)) == call
    (parsed,) = parse_tool_calls(call, "pythonic").calls
    assert (parsed.name, parsed.arguments) == ("calculate", {"expression": "12+19"})
    model = load_model(BUILTIN_AGENT)
    assert model.source == BUILTIN_AGENT and model.config["vocab_size"] == agent.vocab_size
    # what `check` knows of it without loading it
    assert model.config["max_positions"] == AGENT_SHAPE["max_positions"] == BUILTIN_CONTEXTS[BUILTIN_AGENT]
    assert BUILTIN_PARAMS["tiny-agent"] == sum(p.numel() for p in model.module.parameters())
    shape = BUILTIN_SHAPES["tiny-agent"]
    assert (shape.vocab, shape.context) == (agent.vocab_size, AGENT_SHAPE["max_positions"])


def test_a_tool_episode_imitated_trains_the_model_tokens_only():
    from rldsl.runtime.engines.torch.agent_warmstart import tool_episode
    from rldsl.runtime.engines.torch.warmstart import transcript_batch

    tokenizer = builtin_tokenizer(BUILTIN_AGENT)
    prompt = Prompt(0, "12+19=", "31")
    batch = transcript_batch(tokenizer, [prompt, Prompt(1, "1+1=", "2")], [tool_episode(prompt), "2"])
    call = tokenizer.encode("[calculate(expression='12+19')]")
    expected = call + [tokenizer.eos_id] + tokenizer.encode("31") + tokenizer.encode("31") + [tokenizer.eos_id]
    assert batch["response_ids"][0].tolist() == expected
    assert batch["loss_mask"][0].tolist() == [1.0] * (len(call) + 1) + [0.0, 0.0] + [1.0] * 3  # the result: context
    width = len(expected)
    assert batch["response_ids"][1].tolist() == tokenizer.encode("2") + [tokenizer.eos_id] + [0] * (width - 2)
    assert batch["loss_mask"][1].tolist() == [1.0, 1.0] + [0.0] * (width - 2)


@pytest.mark.slow(reason="builds builtin:tiny-agent's warm start (about 26 s alone), which the other tests of "
                         "the agent then load from the cache")
def test_the_agent_warm_start_can_call_the_calculator_and_mostly_answers_carelessly():
    """What RL starts from: calls that work once begun, taken now and then;
    most prompts answered at once, often wrongly."""
    import torch

    from rldsl.runtime.engines.torch.agent_warmstart import load_warm_started_agent, tool_accuracy
    from rldsl.runtime.engines.torch.common import encode_prompts, positions_from_mask
    from rldsl.tasks import load_dataset

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: the other worker's runs keep the other
    try:
        model = load_warm_started_agent("builtin:arith", seed=0)
    finally:
        torch.set_num_threads(threads)
    held_out = load_dataset("builtin:arith", "eval")[:256]
    # 0.95 built here, 0.88 when another test of the suite built the cache first (the order decides)
    assert tool_accuracy(model, held_out) >= 0.85
    assert greedy_episode_accuracy(model, held_out) <= 0.4  # 0.20 measured
    ids, mask = encode_prompts(model.tokenizer, held_out)
    with torch.no_grad():
        logits, _ = model.forward(ids, mask, positions_from_mask(mask), use_cache=False)
    opens_a_call = torch.softmax(logits[:, -1], -1)[:, model.tokenizer.encode("[")[0]].mean()
    assert 0.1 <= opens_a_call <= 0.4  # 0.20 measured: sampled episodes call now and then


def test_episode_evaluation_scores_the_episodes_its_own_player_plays():
    """The evaluator plays each held-out prompt in the environment (the
    calculator included) and scores the episode: the warm-started agent's
    greedy episodes, played independently here, score the same."""
    from rldsl.runtime.ray_lowering.evaluation import Evaluator

    evaluator = Evaluator(tools_plan(), background=False)
    try:
        result = evaluator.evaluate()
    finally:
        evaluator.episodes.close()
    assert result["metric"] == "episode_reward" and result["prompts"] == 32 and "failed" not in result
    assert result["accuracy"] == greedy_episode_accuracy(evaluator.decoder.model, evaluator.prompts)
    assert 0.05 < result["accuracy"] < 0.9  # calls on some prompts, wrong answers on others
    assert 0 < result["tool_calls"] < 1 and result["tool_errors"] < result["tool_calls"]
    assert result["turns"] == pytest.approx(1 + result["tool_calls"], abs=1e-3)  # a call, then the answer


def test_the_default_metric_of_an_episode_pipeline_is_the_episode_reward():
    from rldsl.runtime.ray_lowering.evaluation import evaluates_episodes

    default = tools_plan(**{'eval_metric = "rldsl.environments:episode_reward"': ""})
    assert evaluates_episodes(default) and evaluates_episodes(tools_plan())
    first_turns = {'"rldsl.environments:episode_reward"   #': '"rldsl.rewards:exact_match"   #'}
    assert not evaluates_episodes(tools_plan(**first_turns))


@pytest.mark.parametrize("metric", ['eval_metric = "rldsl.environments:episode_reward"', ""])
def test_episodes_are_not_evaluated_on_the_generators(metric):
    text = PIPELINE.read_text().replace('eval_metric = "rldsl.environments:episode_reward"', metric)
    text = text.replace("eval_size = 128", "eval_size = 128  eval_on = generators")
    result = compile_source(text, str(PIPELINE))
    assert [d.code for d in result.diagnostics if d.severity == "error"] == ["RLP609"]
