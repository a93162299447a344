"""How a conversation becomes tokens, in token space.

The first turn reads the episode's first messages as text (``first_text``),
encoded once by the engine. From then on nothing is re-encoded: the next
turn reads the tokens so far exactly as they were (the prompt, the model's
tokens as sampled, its end-of-turn token included, the environment's), and
each observation joins them as a token delta (``observation_tokens``): the
tokens the conversation's format puts between the model's completion and
its next turn. A template that rewrites earlier turns (Qwen3 drops earlier
``<think>`` blocks), special tokens a decode skips and non-canonical BPE
splits therefore change nothing the model already said.

``TranscriptTurns``: the messages' contents one after another (the builtin
model, and `hf:` models without `chat_template`); ``ChatTemplateTurns``: the
tokenizer's chat template.
"""

from __future__ import annotations

# The assistant turn the template renders before the new messages: a marker no
# template rewrites, so that what follows it is the template's own text.
_PROBE_MARK = "\u2063\u2064\u2063\u2064\u2063"  # invisible, caseless: survives `upper`, `trim`
_PROBE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE_MARK}]


class _Turns:
    def __init__(self, tokenizer, tools: list[dict] | None = None, max_observation_tokens: int | None = None):
        self.tokenizer, self.tools = tokenizer, tools or None  # the tools' schemas, rendered by a template
        self.max_observation_tokens = max_observation_tokens

    def observation_tokens(self, messages: list[dict], ended: bool) -> list[int]:
        """The tokens of ``messages`` after a completion (``ended``: it
        closed with the end-of-turn token), each message's content cut to
        ``max_observation_tokens``."""
        return self._delta([self._cut(message) for message in messages], ended)

    def _cut(self, message: dict) -> dict:
        limit, content = self.max_observation_tokens, message.get("content")
        if not limit or not content:
            return message
        ids = self.tokenizer.encode(content)
        return message if len(ids) <= limit else {**message, "content": self.tokenizer.decode(ids[:limit])}


class TranscriptTurns(_Turns):
    """Contents one after another; the model's end-of-turn token stays in the
    conversation as it was sampled. Tools are not described in the text (the
    model knows them from its training)."""

    def first_text(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return "".join(message.get("content") or "" for message in messages)

    def _delta(self, messages: list[dict], ended: bool) -> list[int]:
        return self.tokenizer.encode(self.first_text(messages))


class ChatTemplateTurns(_Turns):
    """A Hugging Face tokenizer's chat template (``HFTokenizer``). A delta is
    the template over a fixed probe conversation plus the new messages, cut
    after the probe's assistant turn: the template's end of that turn (less
    the end-of-turn token when the model sampled it), then the new messages
    and the next assistant turn opened."""

    def __init__(self, tokenizer, tools: list[dict] | None = None, max_observation_tokens: int | None = None):
        super().__init__(tokenizer, tools, max_observation_tokens)
        self.template = tokenizer.inner
        if not getattr(self.template, "chat_template", None):
            raise ValueError("`chat_template = true`, but the tokenizer has no chat template")
        self.end_of_turn = self.template.decode([tokenizer.eos_id])
        if _PROBE_MARK not in self._render(_PROBE + [{"role": "user", "content": "?"}]):
            raise ValueError("the chat template drops the content of earlier assistant turns, so where a turn "
                             "ends cannot be told; give the model a template that keeps it")

    def first_text(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """``tools``: schemas a request brought (an agent harness's), else the environment's."""
        return self._render(messages, tools)

    def _delta(self, messages: list[dict], ended: bool) -> list[int]:
        rendered = self._render(_PROBE + list(messages))
        tail = rendered[rendered.index(_PROBE_MARK) + len(_PROBE_MARK):]
        if ended and tail.startswith(self.end_of_turn):
            tail = tail[len(self.end_of_turn):]  # the model's own token closed the turn
        return self.tokenizer.encode(tail)

    def _render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return self.template.apply_chat_template(messages, tools=tools or self.tools, tokenize=False,
                                                 add_generation_prompt=True)


def conversation_turns(tokenizer, chat_template: bool, tools: list[dict] | None = None,
                       max_observation_tokens: int | None = None):
    return (ChatTemplateTurns if chat_template else TranscriptTurns)(tokenizer, tools, max_observation_tokens)
