"""Prompt datasets: builtin verifiable tasks and JSON-lines files.

``load_dataset(source, split)`` returns ``list[Prompt]`` for

- ``builtin:arith``   additions such as ``"12+7="`` -> ``"19"``;
- ``builtin:reverse`` ``"reverse abc:"`` -> ``"cba"``;
- ``jsonl:<path>``    one JSON object per line; ``{split}`` in the path is
  replaced by the split name (``jsonl:data/{split}.jsonl``). A path
  without ``{split}`` is one file for both splits: read whole, or with
  ``hold_out`` split by the builtins' prompt-hash rule, so a dataset that
  evaluates on its own training file never sees its eval rows in training.
  A prompt may be a string or a list of chat messages (``{"role",
  "content"}``); a list is kept in ``meta["messages"]`` for the policy's
  chat template to render (``rldsl.runtime.control.prompts``).

Builtin splits are decided by a hash of the prompt text, so train and eval
are disjoint for every seed and every size; the seed only orders (and, for
``reverse``, draws) the prompts. No torch here: the controller imports this.
"""

from __future__ import annotations

import json
import random
import string
import zlib
from pathlib import Path

from rldsl.runtime.protocols import Prompt

SPLITS = ("train", "eval")
EVAL_PER_MILLE = 50  # share of the prompt space held out for evaluation
# the shortest and longest answer of each builtin task, in characters (a test checks them against the data)
ANSWER_CHARACTERS = {"builtin:arith": (1, 3), "builtin:reverse": (3, 5)}


class DatasetError(ValueError):
    """A dataset source that cannot be read; the message names file and line."""


def is_eval_text(text: str) -> bool:
    """The deterministic split rule shared by every builtin task."""
    return zlib.crc32(text.encode()) % 1000 < EVAL_PER_MILLE


def _in_split(text: str, split: str) -> bool:
    return is_eval_text(text) == (split == "eval")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise DatasetError(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")


def _as_prompts(pairs, task: str) -> list[Prompt]:
    return [Prompt(index=i, text=text, answer=answer, meta={"task": task}) for i, (text, answer) in enumerate(pairs)]


def arith_prompts(split: str, seed: int = 0, size: int | None = None, max_operand: int = 99) -> list[Prompt]:
    """Every ``a+b=`` with 0 <= a, b <= max_operand in the split, shuffled by seed."""
    pairs = [
        (f"{a}+{b}=", str(a + b))
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
        if _in_split(f"{a}+{b}=", split)
    ]
    random.Random(f"arith-{split}-{seed}").shuffle(pairs)
    return _as_prompts(pairs[:size], "arith")


def reverse_prompts(
    split: str,
    seed: int = 0,
    size: int | None = None,
    min_length: int = 3,
    max_length: int = 5,
    alphabet: str = string.ascii_lowercase[:8],
) -> list[Prompt]:
    """``size`` distinct random strings of the split (default 20000 train, 500 eval)."""
    size = size or (20000 if split == "train" else 500)
    rng = random.Random(f"reverse-{split}-{seed}")
    seen, pairs = set(), []
    for _ in range(size * 200):
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_length, max_length)))
        text = f"reverse {word}:"
        if word not in seen and _in_split(text, split):
            seen.add(word)
            pairs.append((text, word[::-1]))
            if len(pairs) == size:
                return _as_prompts(pairs, "reverse")
    raise DatasetError(f"builtin:reverse found only {len(pairs)} distinct {split} strings; lower size")


def jsonl_prompts(path: str, split: str, prompt_field: str = "prompt", answer_field: str = "answer",
                  hold_out: bool = False) -> list[Prompt]:
    """Rows of a JSON-lines file, in file order; blank lines are skipped.
    ``hold_out`` (a path without ``{split}``): only the rows of ``split`` by
    the prompt-hash rule (about 5% eval)."""
    hold_out = hold_out and "{split}" not in path
    path = path.replace("{split}", split)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise DatasetError(f"jsonl:{path}: cannot read the file ({error.strerror or error})") from error
    prompts = []
    for line_number, line in enumerate(lines, start=1):
        if line.strip():
            row = _parse_row(path, line_number, line, (prompt_field, answer_field))
            text, messages = _prompt_of(row[prompt_field], f"{path}:{line_number}: `{prompt_field}`")
            if hold_out and not _in_split(json.dumps(messages) if messages else text, split):
                continue
            meta = {"file": path, "line": line_number, **({"messages": messages} if messages else {})}
            prompts.append(Prompt(len(prompts), text, str(row[answer_field]), meta))
    if not prompts and hold_out:
        raise DatasetError(f"{path}: none of its rows falls in the {split} split (about {EVAL_PER_MILLE / 10:g}% "
                           "of prompts, by a hash of the text, are held out for evaluation); give `eval_source`, "
                           "a `{split}` path, more rows, or `eval_size = 0`")
    if not prompts:
        raise DatasetError(f"{path}: the file has no rows")
    return prompts


def _parse_row(path: str, line_number: int, line: str, required: tuple[str, ...]) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise DatasetError(f"{path}:{line_number}: invalid JSON: {error.msg} (column {error.colno})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{path}:{line_number}: expected a JSON object, got {type(row).__name__}")
    for name in required:
        if name not in row:
            present = ", ".join(sorted(row)) or "none"
            raise DatasetError(f"{path}:{line_number}: missing field {name!r} (fields present: {present})")
    return row


def _prompt_of(value, where: str) -> tuple[str, list[dict] | None]:
    """A row's prompt: a string as it is; a list of chat messages as the last
    user turn's content (its text without a chat template) and the messages."""
    if not isinstance(value, list):
        return str(value), None
    if not value:
        raise DatasetError(f"{where} is an empty list; a chat prompt needs at least one message")
    for number, message in enumerate(value, start=1):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DatasetError(f"{where}: message {number} is {json.dumps(message)[:80]}; each chat message is "
                               '{"role": "...", "content": "..."} with string values')
    users = [m["content"] for m in value if m["role"] == "user"]
    return (users[-1] if users else value[-1]["content"]), [dict(m) for m in value]


def holds_messages(source: str, prompt_field: str = "prompt") -> str | None:
    """Where a ``jsonl:`` source's first row holds a list of chat messages
    (``path:line``), else None; a missing or unreadable file is None here
    (reading it reports that). Only the first row is read: a quick look
    before a run starts, at files of any size."""
    if not source.startswith("jsonl:"):
        return None
    path = source[len("jsonl:"):]
    for name in dict.fromkeys(path.replace("{split}", split) for split in SPLITS):
        try:
            with open(name, encoding="utf-8") as lines:
                first = next(((n, line) for n, line in enumerate(lines, start=1) if line.strip()), None)
        except OSError:
            continue
        if first is None:
            continue
        try:
            row = json.loads(first[1])
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get(prompt_field), list):
            return f"{name}:{first[0]}"
    return None


BUILTIN_TASKS = {"builtin:arith": arith_prompts, "builtin:reverse": reverse_prompts}


def load_dataset(source: str, split: str = "train", **options) -> list[Prompt]:
    """The prompts of ``source`` for ``split`` ("train" or "eval").

    Builtin options: ``seed``, ``size`` and the task's own parameters;
    jsonl options: ``prompt_field``, ``answer_field``.
    """
    _check_split(split)
    if source in BUILTIN_TASKS:
        return BUILTIN_TASKS[source](split, **options)
    if source.startswith("jsonl:"):
        return jsonl_prompts(source[len("jsonl:"):], split, **options)
    known = ", ".join([*BUILTIN_TASKS, "jsonl:<path>"])
    raise DatasetError(f"unknown dataset source {source!r}: expected one of {known}")
