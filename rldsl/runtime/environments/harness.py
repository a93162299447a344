"""Agent harnesses: episodes driven through an OpenAI-compatible endpoint.

An environment's ``fn`` may be a function ``harness(client, prompt,
answer) -> reward`` (plain or ``async``) instead of a class: an agent
written against the OpenAI API. Each episode runs it once, in the episode's
own process, with a client on the replica's endpoint (endpoint.py) that
names the episode in every request. The endpoint answers each
chat-completions request with the replica's generator and records it in
token space, as an environment's turns are: the first request's messages
are rendered once (the chat template, with the request's tools); every later
one must extend the conversation so far (the messages sent before, and the
assistant's answers as returned), and only its new messages join the tokens,
as the template's delta. The sample is the episode's tokens exactly as
generated, with the harness's reward; a request that rewrote earlier turns
ends the episode as ``environment_tokenization`` (one conversation per
episode).

Sampling is the generate stage's (``max_new_tokens``, temperature, ...):
a request's own sampling parameters are ignored, so that the behaviour
logprobs are the ones the trainer recomputes. The environment's ``timeout``
bounds the harness's own time, not its waits on the model.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import uuid

from rldsl.runtime import protocols as p
from rldsl.runtime.environments.endpoint import ChatEndpoint, EndpointError
from rldsl.runtime.environments.episodes import (
    Episode,
    answered,
    episode_batch,
    extend,
    has_room,
    open_processes,
    raw_text,
    response_cap,
    take_turn,
)
from rldsl.runtime.environments.host import EnvironmentHost
from rldsl.runtime.environments.protocol import EpisodeStatus
from rldsl.runtime.environments.tool_calls import parse_tool_calls

CALL_SEED_STRIDE = 7919  # each request of an episode draws from its own seed
EPISODE_SEED_STRIDE = 100_003  # ... and each episode of a group from seeds of its own


class _Recorded:
    """An episode as the endpoint sees it."""

    def __init__(self, episode: Episode, seed: int):
        self.episode, self.seed = episode, seed
        self.lock = threading.Lock()  # one request at a time: one conversation
        self.model_s = 0.0  # time spent generating for it (not the harness's)
        self.open = True


class HarnessRunner:
    def __init__(self, batcher, host: EnvironmentHost, turns, tokenizer, max_turns: int, max_tokens: int,
                 tool_format: str | None = None):
        self.batcher, self.host, self.turns, self.tokenizer = batcher, host, turns, tokenizer
        self.max_turns, self.max_tokens, self.tool_format = max_turns, max_tokens, tool_format
        self._token = secrets.token_urlsafe(24)
        self._recorded: dict[str, _Recorded] = {}
        self._lock = threading.Lock()
        self.endpoint = ChatEndpoint(self.complete, self._token)

    def run(self, prompts: list[p.Prompt], samples_per_prompt: int, seed: int) -> tuple[p.Batch, list]:
        episodes = [Episode(prompt) for prompt in prompts for _ in range(samples_per_prompt)]
        ids = [uuid.uuid4().hex for _ in episodes]
        with self._lock:
            records = [_Recorded(e, seed + index * EPISODE_SEED_STRIDE) for index, e in enumerate(episodes)]
            self._recorded.update(zip(ids, records))
        try:
            opened = set(map(id, open_processes(self.host, episodes)))
            started = [(i, e) for i, e in enumerate(episodes) if id(e) in opened]
            calls = [(e.process, ("harness", e.raw_prompt, e.prompt.answer, self.endpoint.url, self._token, ids[i]))
                     for i, e in started]
            replies = self.host.exchange(calls, excused=lambda k: records[started[k][0]].model_s, stragglers=False)
            for (index, episode), reply in zip(started, replies):
                with records[index].lock:
                    records[index].open = False  # a request still in flight is refused from now on
                self._finish(episode, reply)
        finally:
            self.host.finish([e.process for e in episodes if e.process is not None])
            with self._lock:
                for key in ids:
                    self._recorded.pop(key, None)
        failures = [(e.status, e.detail) for e in episodes if e.status != EpisodeStatus.OK]
        return episode_batch(episodes, self.tokenizer, self.batcher.version, self.max_turns), failures

    @staticmethod
    def _finish(episode: Episode, reply) -> None:
        if episode.done or not answered(episode, reply):  # done: the endpoint ended it (a rewritten conversation)
            return
        if not episode.turns:
            episode.fail(EpisodeStatus.RAISED, "the harness returned without calling the model")
        else:
            episode.reward, episode.done = reply[1], True

    # -- the endpoint's side ---------------------------------------------------------------

    def complete(self, episode_id: str, request: dict) -> dict:
        """One chat-completions request of an episode, as OpenAI answers it."""
        with self._lock:
            record = self._recorded.get(episode_id)
        if record is None:
            raise EndpointError(f"no episode {episode_id!r} is running here", status=404, kind="not_found_error")
        with record.lock:
            if not record.open or record.episode.done:
                raise EndpointError("this episode has ended")
            started = time.monotonic()
            try:
                return self._complete(record, request)
            finally:
                record.model_s += time.monotonic() - started

    def _complete(self, record: _Recorded, request: dict) -> dict:
        episode, messages = record.episode, [_wire(m) for m in request["messages"]]
        if episode.turns >= self.max_turns:
            raise EndpointError(f"the episode has had its {self.max_turns} turns (`max_turns`)")
        if len(episode.tokens) >= self.max_tokens:
            raise EndpointError(f"the episode's {self.max_tokens} tokens are used (`max_tokens`)")
        if not episode.prompt_ids:
            prompt = p.Prompt(episode.prompt.index, self.turns.first_text(messages, request.get("tools")),
                              episode.prompt.answer, episode.prompt.meta)
        else:
            new = self._new_messages(episode, messages)
            ended = bool(episode.trained) and episode.trained[-1] == 1 and episode.tokens[-1] == self.tokenizer.eos_id
            extend(episode, self.turns.observation_tokens(new, ended), None,
                   response_cap(self.batcher, episode, self.max_tokens))
            if not has_room(self.batcher, episode):
                episode.context_full, record.open = True, False
                raise EndpointError("the conversation would pass the model's context: this episode takes no more "
                                    "requests (return its reward)")
            prompt = p.Prompt(episode.prompt.index, episode.prompt.text, episode.prompt.answer, episode.prompt.meta,
                              ids=tuple(episode.prompt_ids + episode.tokens))
        batch = self.batcher.submit([prompt], 1, record.seed + CALL_SEED_STRIDE * episode.turns)
        batch.pop(p.FIELD_TOKEN_VERSIONS, None)
        completion = take_turn(episode, batch, 0, self.max_tokens)
        message, finish = self._answer(episode, completion)
        episode.messages = messages + [_wire(message)]
        prompt_tokens = len(episode.prompt_ids) + len(episode.tokens) - len(completion)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": request.get("model", "policy"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(completion),
                          "total_tokens": prompt_tokens + len(completion)}}

    def _new_messages(self, episode: Episode, messages: list[dict]) -> list[dict]:
        known = episode.messages
        if len(messages) <= len(known) or messages[:len(known)] != known:
            episode.fail(EpisodeStatus.TOKENIZATION, "the harness sent a conversation that does not extend the one "
                                                     "so far (one conversation per episode, earlier turns unchanged)")
            raise EndpointError("the messages must extend the conversation so far: the earlier messages unchanged, "
                                "the assistant's as answered; this episode has ended")
        return messages[len(known):]

    def _answer(self, episode: Episode, completion: list[int]) -> tuple[dict, str]:
        """The assistant message (with its tool calls in OpenAI's wire form) and the finish reason."""
        ended = bool(completion) and completion[-1] == self.tokenizer.eos_id
        finish = "stop" if ended else "length"
        if self.tool_format:
            parsed = parse_tool_calls(raw_text(self.tokenizer, completion), self.tool_format, episode.turns)
            episode.tool_calls += len(parsed.calls) + len(parsed.errors)
            episode.tool_errors += len(parsed.errors)
            if parsed.calls:
                calls = [call.message(arguments_as_text=True) for call in parsed.calls]
                return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": self.tokenizer.decode(completion)}, finish

    def close(self) -> None:
        self.endpoint.close()


def _wire(message) -> dict:
    """A request's message as compared and rendered: its role, content
    (``None`` for none) and tool fields; tool-call arguments as JSON text."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise EndpointError(f"a message is an object with a `role`: {message!r:.100}")
    out = {"role": message["role"], "content": message.get("content") or None}
    if isinstance(out["content"], list):  # content parts: their text, in order
        out["content"] = "".join(part.get("text", "") for part in out["content"] if isinstance(part, dict)) or None
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": _arguments_text(c["function"].get("arguments"))}}
                             for c in message["tool_calls"]]
    return out


def _arguments_text(arguments) -> str:
    if isinstance(arguments, str):
        try:
            return json.dumps(json.loads(arguments))  # one spelling, whatever the client's spacing
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments)
