"""How a conversation becomes the text a turn is generated from.

``transcript``: the messages' contents one after another (the builtin model,
and `hf:` models without `chat_template`); ``chat``: the tokenizer's chat
template with the assistant's turn opened. Either way the engine encodes the
whole conversation each turn, and ``split_turn`` checks that the tokens it
read begin with exactly the tokens of the turns before (the prompt, the
model's own tokens as generated, the environment's): otherwise the trainer
would score other tokens than the ones sampled.
"""

from __future__ import annotations


def transcript(messages: list[dict]) -> str:
    return "".join(message["content"] for message in messages)


def chat_renderer(hf_tokenizer):
    """The chat template of a Hugging Face tokenizer (``HFTokenizer.inner``)."""
    if not getattr(hf_tokenizer, "chat_template", None):
        raise ValueError("`chat_template = true`, but the tokenizer has no chat template")
    return lambda messages: hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def split_turn(conversation: list[int], read: list[int]) -> list[int] | None:
    """The environment's tokens of a turn: what the engine ``read`` beyond the
    ``conversation`` so far; None when ``read`` does not begin with it (the
    whole conversation tokenizes differently from its turns)."""
    if read[:len(conversation)] != conversation:
        return None
    return read[len(conversation):]
