"""Agent harnesses written against the OpenAI API: each episode's requests
reach the replica's generator through its chat-completions endpoint and
become one training sample, in token space (rldsl.runtime.environments.harness)."""

import contextlib
import textwrap

import httpx
import openai
import pytest
import torch

from rldsl.models import load_model
from rldsl.runtime import protocols as p
from rldsl.runtime.engines.batching import ContinuousBatcher
from rldsl.runtime.engines.torch.common import response_logprobs
from rldsl.runtime.engines.torch.generate import TorchGenerator
from rldsl.runtime.environments import EpisodeStatus
from rldsl.runtime.environments.conversation import TranscriptTurns
from rldsl.runtime.environments.harness import HarnessRunner
from rldsl.runtime.environments.host import EnvironmentHost
from rldsl.runtime.environments.protocol import EPISODE_HEADER

AGENTS = """
    import openai

    async def retry(client, prompt, answer):
        '''Asks, then asks again with a nudge; full marks when the second answer is right.'''
        messages = [{"role": "user", "content": prompt}]
        first = await client.chat.completions.create(model="policy", messages=messages, temperature=0.0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": f" try {prompt}"}]
        second = await client.chat.completions.create(model="policy", messages=messages)
        return 1.0 if second.choices[0].message.content.strip() == answer else 0.25

    def chatty(client, prompt, answer):
        '''Asks again and again until the endpoint says the model's context is full.'''
        messages = [{"role": "user", "content": prompt}]
        while True:
            try:
                reply = client.chat.completions.create(model="policy", messages=messages)
            except openai.BadRequestError as error:
                assert "pass the model's context" in str(error)
                return 0.5
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": " more"}]

    async def streams(client, prompt, answer):
        '''The same two turns as `retry`, streamed as many agent harnesses always do.'''
        async def ask(messages):
            stream = await client.chat.completions.create(model="policy", messages=messages, stream=True,
                                                          stream_options={"include_usage": True})
            text, finish, usage = "", None, None
            async for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
            assert finish in ("stop", "length") and usage.completion_tokens >= 1
            return text
        messages = [{"role": "user", "content": prompt}]
        first = await ask(messages)
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": f" try {prompt}"}]
        return 1.0 if (await ask(messages)).strip() == answer else 0.25

    def rewrites(client, prompt, answer):
        '''Changes what the model said before asking again: not one conversation.'''
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}])
        try:
            client.chat.completions.create(model="policy", messages=[
                {"role": "user", "content": prompt}, {"role": "assistant", "content": "42"},
                {"role": "user", "content": " again"}])
        except openai.BadRequestError as error:
            assert "must extend the conversation" in str(error)
            return 0.0
        return 9.0
"""


@pytest.fixture(scope="module")
def model():
    return load_model("builtin:tiny-lm", seed=0)


@contextlib.contextmanager
def _runner(model, tmp_path, harness: str, max_turns: int = 3, max_tokens: int = 40):
    """A harness runner on the builtin model, its servers and endpoint stopped after."""
    (tmp_path / "agents.py").write_text(textwrap.dedent(AGENTS))
    host = EnvironmentHost(f"agents:{harness}@{tmp_path}", 20.0, 1)
    assert host.kind == "harness"
    runner = HarnessRunner(ContinuousBatcher(TorchGenerator(model, max_new_tokens=4)), host,
                           TranscriptTurns(model.tokenizer), model.tokenizer, max_turns, max_tokens)
    try:
        yield runner
    finally:
        host.close()
        runner.close()


def _episodes(model, tmp_path, harness: str, prompt: p.Prompt, samples: int, **limits):
    with _runner(model, tmp_path, harness, **limits) as runner:
        return runner.run([prompt], samples, seed=0)


def test_an_openai_client_harness_makes_samples_of_exactly_the_generated_tokens(model, tmp_path):
    batch, failures = _episodes(model, tmp_path, "retry", p.Prompt(0, "12+19=", "31"), 3)
    assert not failures and batch[p.FIELD_TURNS].tolist() == [2, 2, 2]
    assert set(batch[p.FIELD_EPISODE_REWARD].tolist()) <= {1.0, 0.25}
    tokenizer = model.tokenizer
    for row in range(3):
        mask, trained = batch[p.FIELD_RESPONSE_MASK][row].bool(), batch[p.FIELD_LOSS_MASK][row].bool()
        ids = batch[p.FIELD_RESPONSE_IDS][row]
        assert ids[mask & ~trained].tolist() == tokenizer.encode(" try 12+19=")  # the harness's new message
        prompt = batch[p.FIELD_PROMPT_IDS][row][batch[p.FIELD_PROMPT_MASK][row].bool()].tolist()
        assert prompt == tokenizer.encode("12+19=", add_bos=True)
    with torch.no_grad():
        recomputed = response_logprobs(model, batch)
    on_model = p.trained_tokens(batch).bool()
    assert torch.allclose(recomputed[on_model], batch[p.FIELD_BEHAVIOUR_LOGPROBS][on_model], atol=1e-4)


def test_a_streaming_harness_makes_the_same_samples(model, tmp_path):
    """`stream: true` answers with OpenAI's chunks, whose text joins into the
    message the plain request gets: the same episodes, token for token."""
    prompt = p.Prompt(0, "12+19=", "31")
    plain, _ = _episodes(model, tmp_path, "retry", prompt, 3)
    streamed, failures = _episodes(model, tmp_path, "streams", prompt, 3)
    assert not failures and streamed[p.FIELD_TURNS].tolist() == [2, 2, 2]
    for field in (p.FIELD_RESPONSE_IDS, p.FIELD_LOSS_MASK, p.FIELD_BEHAVIOUR_LOGPROBS):
        assert torch.equal(streamed[field], plain[field]), field


def test_a_harness_that_rewrites_the_conversation_ends_its_episode(model, tmp_path):
    batch, failures = _episodes(model, tmp_path, "rewrites", p.Prompt(0, "1+1=", "2"), 2)
    assert [EpisodeStatus(int(s)) for s in batch[p.FIELD_EPISODE_STATUS]] == [EpisodeStatus.TOKENIZATION] * 2
    assert all("does not extend" in detail for _, detail in failures)


def test_a_conversation_that_would_pass_the_models_context_is_refused_and_still_trained(model, tmp_path):
    batch, failures = _episodes(model, tmp_path, "chatty", p.Prompt(0, "1+1=", "2"), 2, max_turns=100, max_tokens=200)
    assert not failures and batch[p.FIELD_EPISODE_REWARD].tolist() == [0.5, 0.5]
    lengths = batch[p.FIELD_PROMPT_MASK].sum(dim=1) + batch[p.FIELD_RESPONSE_MASK].sum(dim=1)
    assert int(lengths.max()) <= 64 and (batch[p.FIELD_TURNS] > 3).all()  # the builtin model's 64 positions


def test_the_endpoint_wants_its_key_and_a_running_episode(model, tmp_path):
    with _runner(model, tmp_path, "retry") as runner:
        ask = {"model": "policy", "messages": [{"role": "user", "content": "1+1="}]}
        stranger = openai.OpenAI(base_url=runner.endpoint.url, api_key="guess", max_retries=0,
                                 default_headers={EPISODE_HEADER: "x"})
        with pytest.raises(openai.AuthenticationError):
            stranger.chat.completions.create(**ask)
        insider = openai.OpenAI(base_url=runner.endpoint.url, api_key=runner._token, max_retries=0,
                                default_headers={EPISODE_HEADER: "no-such-episode"})
        with pytest.raises(openai.NotFoundError, match="no episode"):
            insider.chat.completions.create(**ask)
        assert [m.id for m in insider.models.list()] == ["policy"]
        with httpx.Client(trust_env=False) as http:  # what no client sends: an error in OpenAI's shape, not a crash
            torn = http.post(f"{runner.endpoint.url}/chat/completions", content=b'{"messages": [',
                             headers={"Authorization": f"Bearer {runner._token}", EPISODE_HEADER: "x"})
        assert torn.status_code == 400 and "not JSON" in torn.json()["error"]["message"]
    assert runner.endpoint.url.startswith("http://127.0.0.1:")


def test_streamed_chunks_are_openais_chunk_objects_with_the_tool_calls_indexed():
    from openai.types.chat import ChatCompletionChunk

    from rldsl.runtime.environments.endpoint import stream_chunks

    call = {"id": "call_0", "type": "function", "function": {"name": "calculate", "arguments": '{"expression": "1+1"}'}}
    answer = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "policy",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call, call]},
                           "finish_reason": "tool_calls", "logprobs": None}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}
    chunks = [ChatCompletionChunk.model_validate(c) for c in stream_chunks(answer, include_usage=True)]
    calls = chunks[0].choices[0].delta.tool_calls
    assert [c.index for c in calls] == [0, 1] and calls[1].function.arguments == call["function"]["arguments"]
    assert chunks[1].choices[0].finish_reason == "tool_calls" and chunks[2].usage.total_tokens == 14
    assert len(stream_chunks(answer, include_usage=False)) == 2


# An agent harness in a real run on Ray: tests/test_verifiers_env.py (a verifiers taskset is one).
