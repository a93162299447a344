"""Tool calls: parsed from the model's native format, run in the episode's
process at once, answered as observations, errors included
(rldsl.runtime.environments.tool_calls, host, process)."""

import textwrap
import time

import pytest

from rldsl.environments import calculate
from rldsl.runtime.environments.host import EnvironmentHost
from rldsl.runtime.environments.protocol import EnvironmentLoadError
from rldsl.runtime.environments.tool_calls import ToolCall, parse_tool_calls, tool_schema


def test_hermes_calls_are_read_in_order_and_their_text_is_the_content():
    text = ('Let me add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
            '<tool_call>{"name": "neg", "arguments": "{\\"x\\": 3}"}</tool_call>')
    parsed = parse_tool_calls(text, "hermes", turn=2)
    assert parsed.content == "Let me add."
    assert parsed.calls == [ToolCall("call_2_0", "add", {"a": 1, "b": 2}), ToolCall("call_2_1", "neg", {"x": 3})]
    assert not parsed.errors and parsed.uses_tools
    assert parsed.calls[0].message() == {"id": "call_2_0", "type": "function",
                                         "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}


@pytest.mark.parametrize(("text", "error"), [
    ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "not closed"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'needs a "name"'),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be an object"),
])
def test_a_malformed_hermes_call_is_an_error_to_tell_not_an_exception(text, error):
    parsed = parse_tool_calls(text, "hermes")
    assert not parsed.calls and len(parsed.errors) == 1 and error in parsed.errors[0] and parsed.uses_tools


def test_pythonic_calls_take_named_literal_arguments():
    parsed = parse_tool_calls('sure [add(a=1, b=2), shout(text="hi")]', "pythonic")
    assert parsed.content == "sure" and [c.name for c in parsed.calls] == ["add", "shout"]
    assert parsed.calls[1].arguments == {"text": "hi"}
    assert "named arguments only" in parse_tool_calls("[add(1, 2)]", "pythonic").errors[0]
    assert "not Python literals" in parse_tool_calls("[add(a=x)]", "pythonic").errors[0]
    assert not parse_tool_calls("12+19=31", "pythonic").uses_tools  # an answer is no call


def test_a_tool_schema_comes_from_the_signature_and_docstring():
    def lookup(city: str, days: int = 1, metric: bool = True) -> str:
        """Weather for a city.

        Args:
            city: the city's name
            days (int): how many days ahead
        Returns:
            the forecast
        """

    schema = tool_schema(lookup)["function"]
    assert schema["name"] == "lookup" and schema["description"] == "Weather for a city."
    assert schema["parameters"] == {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "days": {"type": "integer", "description": "how many days ahead"}, "metric": {"type": "boolean"}}}
    assert calculate("12+19") == "31" and calculate("(7-9)*3") == "-6"
    with pytest.raises(ValueError, match="not integer arithmetic"):
        calculate("__import__('os')")


TOOLS = """
    import asyncio, time

    def slow_add(a: int, b: int) -> int:
        '''Add slowly.'''
        time.sleep(0.6)
        return a + b

    async def slow_neg(x: int) -> dict:
        '''Negate slowly.'''
        await asyncio.sleep(0.6)
        return {"value": -x}

    def fails(x: int) -> int:
        '''Always fails.'''
        raise RuntimeError("out of order")

    class Desk:
        tools = [fails]

        def reset(self, prompt, answer):
            return [{"role": "user", "content": prompt}]

        def step(self, messages, completion):
            return "", 1.0, True
"""


def _module(tmp_path, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    return str(tmp_path)


def test_a_turns_calls_run_at_once_and_every_failure_is_an_answer(tmp_path):
    directory = _module(tmp_path, "desk", TOOLS)
    host = EnvironmentHost(f"desk:Desk@{directory}", 10.0, 1,
                           tools=(f"desk:slow_add@{directory}", f"desk:slow_neg@{directory}"))
    try:
        assert sorted(s["function"]["name"] for s in host.tool_schemas) == ["fails", "slow_add", "slow_neg"]
        (process,) = host.open(1)
        host.exchange([(process, ("reset", "hi", ""))])
        started = time.monotonic()
        (reply,) = host.exchange([(process, ("tools", [("slow_add", {"a": 1, "b": 2}), ("slow_neg", {"x": 4}),
                                                       ("slow_add", {"a": 5, "b": 5})]))])
        took = time.monotonic() - started
        (errors,) = host.exchange([(process, ("tools", [("fails", {"x": 1}), ("nope", {}),
                                                        ("slow_add", {"a": 1})]))])
    finally:
        host.close()
    assert reply == ("ok", ["3", '{"value": -4}', "10"]) and took < 1.5, took  # not 3 x 0.6 s one after another
    assert errors[1][0] == "error: RuntimeError: out of order"
    assert errors[1][1] == "error: there is no tool `nope`; the tools are fails, slow_add, slow_neg"
    assert errors[1][2].startswith("error: TypeError:") and "'b'" in errors[1][2]


def test_a_tool_that_does_not_import_fails_at_start(tmp_path):
    with pytest.raises(EnvironmentLoadError, match="tool 'no_such_module:f'"):
        EnvironmentHost("rldsl.environments:ArithRetry", 1.0, 1, tools=("no_such_module:f",))


TEMPLATE = ("{% for m in messages %}<bos>{{ m['role'][0] }}:{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<bos>a:{% endif %}")
CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "12+19"}}</tool_call>'


def _tool_using_llama(tmp_path):
    """A tiny Llama taught, in a few hundred steps, the one conversation it
    should have: call the calculator in the Hermes form, then answer."""
    import json

    import torch

    from rldsl.models import load_model
    from tests.hf_tiny import save_char_llama

    path = save_char_llama(tmp_path / "model", extra_tokens=("<tool_call>", "</tool_call>", "{", "}", '"'),
                           max_position_embeddings=256)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    model = load_model(f"hf:{path}")
    encode = model.tokenizer.encode
    eos = model.tokenizer.eos_id
    parts = [(encode("<bos>u:12+19=<bos>a:"), 0), (encode(CALL) + [eos], 1), (encode("<bos>t:31<bos>a:"), 0),
             (encode("31") + [eos], 1)]
    ids = torch.tensor([[token for tokens, _ in parts for token in tokens]])
    learn = torch.tensor([[flag for tokens, flag in parts for _ in tokens]])[:, 1:].bool()
    optimizer = torch.optim.Adam(model.module.parameters(), lr=2e-2)
    for _ in range(120):
        logits = model.module(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[learn], ids[:, 1:][learn])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 1e-3, loss.item()
    return model


def test_a_model_that_calls_a_tool_gets_its_result_and_answers(tmp_path):
    """A real torch engine samples a Hermes tool call; the episode runs it
    (the builtin calculator, in the episode's process), the result joins
    the conversation as the template's tool turn, and the model's answer
    goes to the environment's `step`."""
    import torch

    from rldsl.runtime import protocols as p
    from rldsl.runtime.engines.batching import ContinuousBatcher
    from rldsl.runtime.engines.torch.common import response_logprobs
    from rldsl.runtime.engines.torch.generate import TorchGenerator
    from rldsl.runtime.environments import episode_rewards
    from rldsl.runtime.environments.conversation import ChatTemplateTurns
    from rldsl.runtime.environments.episodes import EpisodeRunner

    model = _tool_using_llama(tmp_path)
    host = EnvironmentHost("rldsl.environments:ArithRetry", 10.0, 1, tools=("rldsl.environments:calculate",))
    try:
        runner = EpisodeRunner(ContinuousBatcher(TorchGenerator(model, max_new_tokens=80)), host,
                               ChatTemplateTurns(model.tokenizer, host.tool_schemas), model.tokenizer, 3, 120,
                               tool_format="hermes")
        batch, failures = runner.run([p.Prompt(0, "12+19=", "31")], 2, seed=0)
    finally:
        host.close()
    assert not failures
    assert batch[p.FIELD_TURNS].tolist() == [2, 2] and batch[p.FIELD_TOOL_CALLS].tolist() == [1, 1]
    assert batch[p.FIELD_TOOL_ERRORS].tolist() == [0, 0] and batch[p.FIELD_EPISODE_REWARD].tolist() == [1.0, 1.0]
    inner = model.tokenizer.inner
    for row in range(2):
        mask, trained = batch[p.FIELD_RESPONSE_MASK][row].bool(), batch[p.FIELD_LOSS_MASK][row].bool()
        ids = batch[p.FIELD_RESPONSE_IDS][row]
        assert inner.decode(ids[mask & trained].tolist()) == CALL + "<eos>31<eos>"  # the model's, as sampled
        assert inner.decode(ids[mask & ~trained].tolist()) == "<bos>t:31<bos>a:"  # the tool's answer
    with torch.no_grad():
        recomputed = response_logprobs(model, batch)
    on_model = p.trained_tokens(batch).bool()
    assert torch.allclose(recomputed[on_model], batch[p.FIELD_BEHAVIOUR_LOGPROBS][on_model], atol=1e-4)
    fields = {f: batch[f] for f in (p.FIELD_EPISODE_REWARD, p.FIELD_EPISODE_STATUS, p.FIELD_TURNS,
                                    p.FIELD_TOOL_CALLS, p.FIELD_TOOL_ERRORS)}
    assert episode_rewards(fields)[0].stats == {"turns": 2.0, "tool_calls": 1.0, "tool_errors": 0.0}
