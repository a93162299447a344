"""The episode loop: one prompt group's samples, each a multi-turn episode.

Every episode runs on its own (a thread each): no lockstep per group, so a
sample whose environment is slow, or whose turns are long, holds up only
itself. Each of its turns is a request of its own to the generator's
batcher, which decodes it in one running batch with every other request in
flight: the first turn its messages as text, every later turn its tokens so
far, exactly as they are (``conversation``). Each completion goes to its
environment's ``step`` (in the host's processes) and the observation joins
the tokens as the conversation format's delta; an episode's process ends as
soon as the episode does. A
sample's response is completion 1 + observation 1 + completion 2 + ...:
``loss_mask`` is 1 on the model's tokens, each turn's end-of-turn token
included (the policy learns to end its turns), and 0 on the environment's,
whose behaviour logprobs are 0. The response stops at the environment's
``max_tokens``, and an episode ends before a turn that would pass the
model's context. With a ``tool_format``, a completion that calls tools is a
tool turn: its calls run in the episode's process and their results are the
observation (``tool_calls``).

An episode whose environment raises, hangs or dies ends there with its
status; the reward stage drops that sample alone. A sample's version is its
oldest turn's (each turn's behaviour logprobs are under the weights that
drew it).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from rldsl.runtime import protocols as p
from rldsl.runtime.environments.host import CallFailure, EnvironmentHost, EpisodeProcess
from rldsl.runtime.environments.protocol import EpisodeStatus
from rldsl.runtime.environments.tool_calls import ParsedTurn, parse_tool_calls

TURN_SEED_STRIDE = 7919  # each turn's request draws from its own seed
SAMPLE_SEED_STRIDE = 104729  # and each sample's turns from seeds of their own


@dataclass
class Episode:
    prompt: p.Prompt
    messages: list[dict] = field(default_factory=list)
    process: EpisodeProcess | None = None  # where its environment lives, from reset to the episode's end
    prompt_ids: list[int] = field(default_factory=list)  # the first turn's, as the engine read it
    tokens: list[int] = field(default_factory=list)  # the response: model and environment tokens
    trained: list[int] = field(default_factory=list)  # 1 on the model's tokens
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)  # the environment's reward at each model turn (NaN: none)
    turns: int = 0
    tool_calls: int = 0  # calls made, read or not
    tool_errors: int = 0  # calls that could not be read, named no tool, or whose tool raised
    context_full: bool = False  # ended because another turn would pass the model's context
    versions: list[int] = field(default_factory=list)
    status: EpisodeStatus = EpisodeStatus.OK
    detail: str = ""
    done: bool = False

    def fail(self, status: EpisodeStatus, detail: str) -> None:
        self.status, self.detail, self.done = status, detail, True

    @property
    def raw_prompt(self) -> str:
        """The prompt as written, before any chat template (what the environment is given)."""
        return (self.prompt.meta or {}).get("raw_prompt", self.prompt.text)


class EpisodeRunner:
    """Runs a generate stage's episodes on its ``batcher`` (``submit(prompts,
    samples, seed)`` and ``version``); ``turns`` (``conversation``) gives
    the first turn's text and each observation's tokens."""

    def __init__(self, batcher, host: EnvironmentHost, turns, tokenizer, max_turns: int, max_tokens: int,
                 tool_format: str | None = None):
        self.batcher, self.host, self.turns, self.tokenizer = batcher, host, turns, tokenizer
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.tool_format = tool_format  # None: completions are never read as tool calls

    def run(self, prompts: list[p.Prompt], samples_per_prompt: int, seed: int) -> tuple[p.Batch, list]:
        """Rows prompt-major, like a single-turn group, plus the episode
        fields; and ``(status, detail)`` of each episode that failed."""
        episodes = [Episode(prompt) for prompt in prompts for _ in range(samples_per_prompt)]
        try:
            self._start(episodes)
            with ThreadPoolExecutor(max_workers=len(episodes), thread_name_prefix="episode") as pool:
                list(pool.map(self._play, episodes, [seed + SAMPLE_SEED_STRIDE * i for i in range(len(episodes))]))
        finally:
            self.host.finish([e.process for e in episodes if e.process is not None])
        failures = [(e.status, e.detail) for e in episodes if e.status != EpisodeStatus.OK]
        if full := sum(e.context_full for e in episodes):
            logging.getLogger(__name__).warning(
                "%d of %d episodes of prompt %d ended at the model's context: another turn of up to %d tokens "
                "would not fit (lower the environment's max_tokens or max_turns to end them sooner)", full,
                len(episodes), prompts[0].index, getattr(_engine(self.batcher), "max_new_tokens", 0))
        return episode_batch(episodes, self.tokenizer, self.batcher.version, self.max_turns), failures

    def _play(self, episode: Episode, seed: int) -> None:
        """One episode's turns, each as soon as the one before it has its observation; its process ends
        with it."""
        try:
            for turn in range(self.max_turns):
                if episode.done or not self._has_room(episode):
                    break
                self._turn(episode, turn, seed + TURN_SEED_STRIDE * turn)
        finally:
            if episode.process is not None:
                self.host.finish([episode.process])
                episode.process = None

    def _start(self, episodes: list[Episode]) -> None:
        """Each episode's process, and its environment's first messages."""
        started = open_processes(self.host, episodes)
        replies = self.host.exchange([(e.process, ("reset", e.raw_prompt, e.prompt.answer)) for e in started])
        for episode, reply in zip(started, replies):
            if answered(episode, reply):
                episode.messages = reply[1]

    def _has_room(self, episode: Episode) -> bool:
        """Whether a whole turn still fits the model's context; an episode
        that has no room left ends there, as one at ``max_tokens`` does."""
        if has_room(self.batcher, episode):
            return True
        episode.done = episode.context_full = True
        return False

    def _request(self, episode: Episode) -> p.Prompt:
        """The first turn reads the messages as text; every later turn the tokens so far, as they are."""
        prompt = episode.prompt
        if not episode.prompt_ids:
            return p.Prompt(prompt.index, self.turns.first_text(episode.messages), prompt.answer, prompt.meta)
        return p.Prompt(prompt.index, prompt.text, prompt.answer, prompt.meta,
                        ids=tuple(episode.prompt_ids + episode.tokens))

    def _turn(self, episode: Episode, turn: int, seed: int) -> None:
        """One model turn of the episode (a request of its own) and its environment's answer."""
        batch = self.batcher.submit([self._request(episode)], 1, seed)
        completion = take_turn(episode, batch, 0, self.max_tokens)
        message, parsed = self._call_for(episode, completion, turn)
        (reply,) = self.host.exchange([(episode.process, message)])
        if not answered(episode, reply):
            return
        if parsed is None:  # the environment's step
            observation, reward, done = reply[1]
            episode.reward += reward
            episode.turn_rewards.append(float(reward))
            said, heard = {"role": "assistant", "content": self._text(completion)}, [observation]
        else:  # tool calls: their results are the observation, and the environment gave no reward
            (said, heard), done = self._tool_turn(episode, parsed, reply[1]), False
            episode.turn_rewards.append(float("nan"))
        episode.messages += [said, *heard]
        if done or turn == self.max_turns - 1 or len(episode.tokens) >= self.max_tokens:
            episode.done = True
            return
        ended = bool(completion) and completion[-1] == self.tokenizer.eos_id
        extend(episode, self.turns.observation_tokens(heard, ended), None,
               response_cap(self.batcher, episode, self.max_tokens))
        # the environment's answer filled the budget: no room to reply
        episode.done = len(episode.tokens) >= self.max_tokens

    def _call_for(self, episode: Episode, completion: list[int], turn: int) -> tuple[tuple, ParsedTurn | None]:
        """The call a completion makes: its tool calls when it has any (with
        what was parsed), else the environment's step."""
        if self.tool_format:
            parsed = parse_tool_calls(raw_text(self.tokenizer, completion), self.tool_format, turn)
            if parsed.uses_tools:
                return ("tools", [(call.name, call.arguments) for call in parsed.calls]), parsed
        return ("step", episode.messages, self._text(completion)), None

    @staticmethod
    def _tool_turn(episode: Episode, parsed: ParsedTurn, results: list[str]) -> tuple[dict, list[dict]]:
        """The assistant's message with its calls, and the observation: one
        ``tool`` message per call, then one per call that could not be read."""
        heard = [{"role": "tool", "name": call.name, "tool_call_id": call.id, "content": result}
                 for call, result in zip(parsed.calls, results)]
        heard += [{"role": "tool", "content": f"error: {error}"} for error in parsed.errors]
        episode.tool_calls += len(parsed.calls) + len(parsed.errors)
        episode.tool_errors += len(parsed.errors) + sum(result.startswith("error:") for result in results)
        said = {"role": "assistant", "content": parsed.content, "tool_calls": [call.message() for call in parsed.calls]}
        return said, heard

    def _text(self, completion: list[int]) -> str:
        return self.tokenizer.decode(completion)


def episode_batch(episodes: list[Episode], tokenizer, version: int, max_turns: int) -> p.Batch:
    """Rows prompt-major: each episode's prompt (left-padded, like an engine's) and response, with the
    episode fields (``max_turns`` wide, the turn rewards: every group's rows the same width)."""
    for e in episodes:
        if not e.prompt_ids:  # failed before its first turn: a row still needs a prompt
            e.prompt_ids = tokenizer.encode(e.prompt.text, add_bos=True)
    prompt_width = max(len(e.prompt_ids) for e in episodes) or 1
    width = max(1, max(len(e.tokens) for e in episodes))
    rows = len(episodes)
    batch = {name: torch.zeros(rows, prompt_width, dtype=torch.long)
             for name in (p.FIELD_PROMPT_IDS, p.FIELD_PROMPT_MASK)}
    for name in (p.FIELD_RESPONSE_IDS, p.FIELD_RESPONSE_MASK, p.FIELD_LOSS_MASK):
        batch[name] = torch.zeros(rows, width, dtype=torch.long)
    batch[p.FIELD_BEHAVIOUR_LOGPROBS] = torch.zeros(rows, width)
    for row, e in enumerate(episodes):
        if e.prompt_ids:  # left-padded, like the engine's
            batch[p.FIELD_PROMPT_IDS][row, prompt_width - len(e.prompt_ids):] = torch.tensor(e.prompt_ids)
            batch[p.FIELD_PROMPT_MASK][row, prompt_width - len(e.prompt_ids):] = 1
        n = len(e.tokens)
        batch[p.FIELD_RESPONSE_IDS][row, :n] = torch.tensor(e.tokens, dtype=torch.long)
        batch[p.FIELD_RESPONSE_MASK][row, :n] = 1
        batch[p.FIELD_LOSS_MASK][row, :n] = torch.tensor(e.trained, dtype=torch.long)
        batch[p.FIELD_BEHAVIOUR_LOGPROBS][row, :n] = torch.tensor(e.logprobs, dtype=torch.float32)
    batch[p.FIELD_VERSION] = torch.tensor([min(e.versions, default=version) for e in episodes])
    batch[p.FIELD_EPISODE_REWARD] = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
    batch[p.FIELD_EPISODE_STATUS] = torch.tensor([int(e.status) for e in episodes], dtype=torch.long)
    batch[p.FIELD_TURNS] = torch.tensor([e.turns for e in episodes], dtype=torch.long)
    batch[p.FIELD_TOOL_CALLS] = torch.tensor([e.tool_calls for e in episodes], dtype=torch.long)
    batch[p.FIELD_TOOL_ERRORS] = torch.tensor([e.tool_errors for e in episodes], dtype=torch.long)
    batch[p.FIELD_TURN_REWARDS] = torch.full((rows, max(1, max_turns)), float("nan"))
    for row, e in enumerate(episodes):
        batch[p.FIELD_TURN_REWARDS][row, :len(e.turn_rewards)] = torch.tensor(e.turn_rewards[:max_turns])
    batch[p.FIELD_CONTEXT_FULL] = torch.tensor([int(e.context_full) for e in episodes], dtype=torch.long)
    return batch


def take_turn(episode: Episode, batch: p.Batch, row: int, max_tokens: int) -> list[int]:
    """Row ``row`` of a generated batch as the episode's next model turn:
    its prompt (the first time), its completion exactly as sampled (the
    end-of-turn token included) with its logprobs, and its version. The
    completion, whole."""
    if not episode.prompt_ids:
        episode.prompt_ids = _masked(batch[p.FIELD_PROMPT_IDS][row], batch[p.FIELD_PROMPT_MASK][row])
    mask = batch[p.FIELD_RESPONSE_MASK][row]
    completion = _masked(batch[p.FIELD_RESPONSE_IDS][row], mask)
    logprobs = batch[p.FIELD_BEHAVIOUR_LOGPROBS][row][mask.bool()].tolist() \
        if p.FIELD_BEHAVIOUR_LOGPROBS in batch else [0.0] * len(completion)
    episode.versions.append(int(batch[p.FIELD_VERSION][row]))
    episode.turns += 1
    extend(episode, completion, logprobs, max_tokens)
    return completion


def extend(episode: Episode, tokens: list[int], logprobs: list[float] | None, max_tokens: int) -> None:
    """Append the model's tokens (with their logprobs) or the environment's
    (None: masked out of the loss, logprob 0), at most up to ``max_tokens``."""
    kept = tokens[:max_tokens - len(episode.tokens)]
    episode.tokens += kept
    episode.trained += [0 if logprobs is None else 1] * len(kept)
    episode.logprobs += [0.0] * len(kept) if logprobs is None else logprobs[:len(kept)]


def answered(episode: Episode, reply) -> bool:
    """Whether a call answered ``("ok", ...)``; else the episode fails with what happened."""
    if isinstance(reply, CallFailure):
        episode.fail(reply.status, reply.detail)
    elif reply[0] != "ok":
        episode.fail(EpisodeStatus.RAISED, reply[1])
    return not episode.done


def open_processes(host: EnvironmentHost, episodes: list[Episode]) -> list[Episode]:
    """A process for each episode (one that cannot get one fails); the episodes that got one."""
    for episode, process in zip(episodes, host.open(len(episodes))):
        if isinstance(process, CallFailure):
            episode.fail(process.status, process.detail)
        else:
            episode.process = process
    return [e for e in episodes if not e.done]


def has_room(batcher, episode: Episode) -> bool:
    """Whether the episode's tokens so far and a whole turn fit the generator's
    context (``max_tokens`` may still cut the turn short); a first turn always does."""
    engine = _engine(batcher)
    limit, turn = getattr(engine, "context_limit", None), getattr(engine, "max_new_tokens", 0)
    return not limit or not episode.prompt_ids or len(episode.prompt_ids) + len(episode.tokens) + turn <= limit


def response_cap(batcher, episode: Episode, max_tokens: int) -> int:
    """The episode's response tokens at most: ``max_tokens``, and what the model's context leaves."""
    limit = getattr(_engine(batcher), "context_limit", None)
    return min(max_tokens, limit - len(episode.prompt_ids)) if limit else max_tokens


def _engine(batcher):
    return getattr(batcher, "engine", batcher)


def raw_text(tokenizer, completion: list[int]) -> str:
    """A completion's text with its special tokens (a tool call's may be), less its end-of-turn token."""
    if completion and completion[-1] == tokenizer.eos_id:
        completion = completion[:-1]
    inner = getattr(tokenizer, "inner", None)
    return inner.decode(completion, skip_special_tokens=False) if inner is not None else tokenizer.decode(completion)


def _masked(ids, mask) -> list[int]:
    return [int(i) for i, keep in zip(ids.tolist(), mask.tolist()) if keep]
