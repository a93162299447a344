"""Tool calls in a model's native format, and tools' JSON schemas.

Formats (an environment's ``tool_format``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call (Hermes, Qwen2.5, Qwen3 and the models trained on their
  templates);
- ``pythonic``: ``[name(arg=value, ...), ...]``, Python literals as
  arguments (Llama 3.2 / 4 and Pythia-style tool use).

Llama 3.1's JSON form and Mistral's ``[TOOL_CALLS]`` are not parsed yet.

A call that cannot be read (bad JSON, arguments that are not an object, an
unterminated block) is kept as an error the model is told about, never an
exception: a malformed call is an observation.

No torch and no transformers here: the environment's processes import this.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import typing
from dataclasses import dataclass, field

from rldsl.plan import TOOL_FORMATS

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_PYTHONIC_LIST = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(.*\)\s*\]", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict

    def message(self, arguments_as_text: bool = False) -> dict:
        """As an assistant message's ``tool_calls`` entry (OpenAI's shape, which
        chat templates read); ``arguments_as_text``: OpenAI's wire form, the
        arguments as JSON text."""
        arguments = json.dumps(self.arguments) if arguments_as_text else self.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclass
class ParsedTurn:
    content: str  # the completion's text outside the calls
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # calls that could not be read, each told to the model

    @property
    def uses_tools(self) -> bool:
        return bool(self.calls or self.errors)


def parse_tool_calls(text: str, tool_format: str, turn: int = 0) -> ParsedTurn:
    if tool_format == "hermes":
        return _hermes(text, turn)
    if tool_format == "pythonic":
        return _pythonic(text, turn)
    raise ValueError(f"unknown tool format {tool_format!r}; expected one of {', '.join(TOOL_FORMATS)}")


def _hermes(text: str, turn: int) -> ParsedTurn:
    parsed = ParsedTurn(_HERMES_BLOCK.sub("", text).strip())
    for index, match in enumerate(_HERMES_BLOCK.finditer(text)):
        body, closed = match.group(1).strip(), match.group(2)
        if not closed:
            parsed.errors.append("a <tool_call> block was not closed with </tool_call>")
            continue
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            parsed.errors.append(f"the tool call is not valid JSON ({error.msg} at character {error.pos})")
            continue
        _add(parsed, call.get("name") if isinstance(call, dict) else None,
             call.get("arguments", {}) if isinstance(call, dict) else None, turn, index)
    return parsed


def _pythonic(text: str, turn: int) -> ParsedTurn:
    match = _PYTHONIC_LIST.search(text)
    if match is None:
        return ParsedTurn(text.strip())
    parsed = ParsedTurn((text[:match.start()] + text[match.end():]).strip())
    try:
        tree = ast.parse(match.group(0), mode="eval").body
    except SyntaxError as error:
        parsed.errors.append(f"the tool calls are not a Python list of calls ({error.msg})")
        return parsed
    for index, node in enumerate(tree.elts if isinstance(tree, ast.List) else []):
        if not isinstance(node, ast.Call) or node.args:
            parsed.errors.append("each tool call is `name(argument=value, ...)`, with named arguments only")
            continue
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except ValueError:
            parsed.errors.append(f"the arguments of `{ast.unparse(node.func)}` are not Python literals")
            continue
        _add(parsed, ast.unparse(node.func), arguments, turn, index)
    return parsed


def _add(parsed: ParsedTurn, name, arguments, turn: int, index: int) -> None:
    if isinstance(arguments, str):  # OpenAI's wire form: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(name, str) or not name:
        parsed.errors.append('a tool call needs a "name" (a string)')
    elif not isinstance(arguments, dict):
        parsed.errors.append(f'the "arguments" of `{name}` must be an object')
    else:
        parsed.calls.append(ToolCall(f"call_{turn}_{index}", name, arguments))


# -- schemas --------------------------------------------------------------------------

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
_ARG_LINE = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$")


def tool_schema(fn) -> dict:
    """The OpenAI-style function schema chat templates render, from ``fn``'s
    signature, type hints and Google-style docstring (the shape of
    transformers' ``get_json_schema``, built here so that the environment's
    processes need not import transformers)."""
    doc = inspect.getdoc(fn) or ""
    summary, _, rest = doc.partition("\n\n")
    described = _argument_descriptions(rest)
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for name, parameter in inspect.signature(fn).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        prop = {"type": _json_type(hints.get(name, str))}
        if name in described:
            prop["description"] = described[name]
        properties[name] = prop
        if parameter.default is parameter.empty:
            required.append(name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": fn.__name__, "description": " ".join(summary.split()),
                                             "parameters": parameters}}


def _json_type(hint) -> str:
    origin = typing.get_origin(hint) or hint
    return _JSON_TYPES.get(origin, "string")


def _argument_descriptions(text: str) -> dict[str, str]:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:")), None)
    found = {}
    for line in lines[start + 1:] if start is not None else []:
        if line.strip().endswith(":") and not line.startswith((" ", "\t")):
            break  # the next section (Returns:, Raises:)
        if match := _ARG_LINE.match(line):
            found[match.group(1)] = match.group(2).strip()
    return found


def result_text(value) -> str:
    """A tool's return value as the content of its ``tool`` message."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
