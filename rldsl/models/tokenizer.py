"""A character-level tokenizer with a fixed, small vocabulary.

Ids 0-3 are special (pad, bos, eos, unk); every other id is one character.
Pad is 0 because the batch format pads with 0 (see runtime/protocols.py).
"""

from __future__ import annotations

import json
import string
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
DEFAULT_CHARACTERS = string.digits + string.ascii_lowercase + " +-*=?:.,!'()/_"
# builtin:tiny-agent's: the default ones and those a native tool call is written with
# (pythonic `[f(x='1')]`, Hermes `<tool_call>{"name": ...}</tool_call>`), appended so every
# default character keeps its id
AGENT_CHARACTERS = DEFAULT_CHARACTERS + '[]{}<>"'


class CharTokenizer:
    """Maps each character to one id; unknown characters map to ``<unk>``."""

    def __init__(self, characters: str = DEFAULT_CHARACTERS):
        if len(set(characters)) != len(characters):
            raise ValueError("tokenizer characters must be unique")
        self.characters = characters
        self._id_of = {ch: i + len(SPECIAL_TOKENS) for i, ch in enumerate(characters)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = range(len(SPECIAL_TOKENS))

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.characters)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self._id_of.get(ch, self.unk_id) for ch in text]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids, stop_at_eos: bool = True) -> str:
        """Text of ``ids``, skipping special tokens (and everything after EOS)."""
        chars = []
        for token in ids:
            token = int(token)
            if token == self.eos_id and stop_at_eos:
                break
            if token >= len(SPECIAL_TOKENS):
                chars.append(self.characters[token - len(SPECIAL_TOKENS)])
        return "".join(chars)

    def save(self, path: str | Path) -> None:
        payload = {"type": "char", "special_tokens": list(SPECIAL_TOKENS), "characters": self.characters}
        Path(path).write_text(json.dumps(payload, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "CharTokenizer":
        payload = json.loads(Path(path).read_text())
        if payload.get("type") != "char" or payload.get("special_tokens") != list(SPECIAL_TOKENS):
            raise ValueError(f"{path}: not a character tokenizer saved by rldsl")
        return cls(payload["characters"])
