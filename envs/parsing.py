"""Reading actions out of model text: tool calls in the formats real models emit, and final answers.

Model output is untrusted. Nothing here raises on it: every problem becomes a `ParseError` whose
message is written for the model to read and correct.

Formats:
- `hermes`: Qwen/Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several per message.
- `code`: fenced ```python blocks (tool-integrated reasoning), each a call of the `python` tool.
- `json`: a message that is wholly one JSON call, as Llama 3.x templates ask for
  (`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`), or Mistral's
  `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` list.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_CHARS = 65_536
"""A single tool call's text beyond this is refused (a runaway generation, not a call)."""
MAX_CALLS_PER_MESSAGE = 8
FORMATS = ("hermes", "code", "json")
LLAMA_PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"

_FENCE = re.compile(r"```[ \t]*(python|py)[ \t]*\n(.*?)(```|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for."""

    name: str
    """The tool's registered name."""
    arguments: dict[str, Any]
    """Arguments as the model wrote them (validated later against the tool's signature)."""
    start: int = 0
    """Offset of the call in the message (calls run in text order)."""


@dataclass(frozen=True)
class ParseError:
    """A malformed call, explained for the model."""

    message: str
    start: int = 0


@dataclass(frozen=True)
class Parsed:
    """Everything actionable in one assistant message."""

    calls: tuple[ToolCall, ...] = ()
    errors: tuple[ParseError, ...] = field(default=())

    @property
    def attempted(self) -> bool:
        """True if the model tried to call a tool, well-formed or not."""
        return bool(self.calls or self.errors)


def parse_hermes(text: str) -> Parsed:
    """`<tool_call>` JSON blocks; nested, unclosed or stray tags and bad JSON become errors."""
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    position = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, position)
        stray = text.find(TOOL_CALL_CLOSE, position)
        if stray != -1 and (start == -1 or stray < start):
            errors.append(ParseError(f"found {TOOL_CALL_CLOSE} without a matching {TOOL_CALL_OPEN}", stray))
        if start == -1:
            break
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        nested = text.find(TOOL_CALL_OPEN, body_start)
        if end == -1:
            errors.append(ParseError(f"{TOOL_CALL_OPEN} is never closed with {TOOL_CALL_CLOSE}", start))
            break
        if nested != -1 and nested < end:
            errors.append(ParseError(f"{TOOL_CALL_OPEN} tags cannot be nested", start))
            position = end + len(TOOL_CALL_CLOSE)
            continue
        body = text[body_start:end]
        position = end + len(TOOL_CALL_CLOSE)
        call = _hermes_call(body, start)
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            errors.append(call)
    return Parsed(tuple(calls), tuple(errors))


def _hermes_call(body: str, start: int) -> ToolCall | ParseError:
    if len(body) > MAX_CALL_CHARS:
        return ParseError(f"a tool call may hold at most {MAX_CALL_CHARS} characters", start)
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as error:
        reason = error.msg if isinstance(error, json.JSONDecodeError) else "nested too deeply"
        return ParseError(f"the tool call is not valid JSON ({reason})", start)
    if not isinstance(data, dict):
        return ParseError('a tool call must be a JSON object like {"name": ..., "arguments": {...}}', start)
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return ParseError('the tool call has no "name" string', start)
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models encode the arguments object as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ParseError(f'"arguments" of {name} is a string that is not a JSON object', start)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ParseError(f'"arguments" of {name} must be a JSON object', start)
    return ToolCall(name, arguments, start)


def parse_code_blocks(text: str, tool_name: str = "python") -> Parsed:
    """Fenced ```python blocks, each a call of `tool_name` with `{"code": ...}`."""
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    for match in _FENCE.finditer(text):
        code = match.group(2)
        if match.group(3) != "```":
            errors.append(ParseError("a ```python block is never closed with ```", match.start()))
        elif len(code) > MAX_CALL_CHARS:
            errors.append(
                ParseError(f"a code block may hold at most {MAX_CALL_CHARS} characters", match.start())
            )
        elif code.strip():
            calls.append(ToolCall(tool_name, {"code": code}, match.start()))
    return Parsed(tuple(calls), tuple(errors))


def parse_json_calls(text: str) -> Parsed:
    """The calls of a message that is wholly JSON calls (the `json` format). A message opened by
    Mistral's `[TOOL_CALLS]` or Llama's `<|python_tag|>` marker is a call attempt: anything malformed
    after it is an error. A bare JSON object is a call only when it has a `name` and `parameters` or
    `arguments` (`{"name": "Paris"}` is an answer, not a call), so a plain JSON answer stays one."""
    whole = text.strip()
    marker = next((m for m in (MISTRAL_TOOL_CALLS, LLAMA_PYTHON_TAG) if whole.startswith(m)), "")
    body = whole[len(marker) :].strip()
    if not marker and not body.startswith("{"):
        return Parsed()
    if len(body) > MAX_CALL_CHARS:
        return Parsed(errors=(ParseError(f"a tool call may hold at most {MAX_CALL_CHARS} characters"),))
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        data = None
    items = data if isinstance(data, list) else [data]
    looks_like_calls = all(
        isinstance(item, dict) and ("parameters" in item or "arguments" in item) for item in items
    )
    if not (data is not None and items and looks_like_calls):
        if not marker:
            return Parsed()
        shape = 'a JSON list of {"name": ..., "arguments": {...}}' if marker == MISTRAL_TOOL_CALLS else (
            'one JSON object {"name": ..., "parameters": {...}}'
        )  # fmt: skip
        return Parsed(errors=(ParseError(f"{marker} must be followed by {shape}"),))
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    for item in items:
        call = _hermes_call(json.dumps(item), 0)
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            errors.append(call)
    return Parsed(tuple(calls), tuple(errors))


def parse_actions(text: str, formats: tuple[str, ...] = FORMATS) -> Parsed:
    """Every call in `text` under the given formats, in text order, capped at MAX_CALLS_PER_MESSAGE."""
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise ValueError(f"unknown tool-call format(s) {sorted(unknown)}; known: {FORMATS}")
    found: list[Parsed] = []
    remaining = text
    if "hermes" in formats:
        found.append(parse_hermes(text))
        # Code inside a <tool_call> is that call's argument, not a second call.
        remaining = re.sub(
            r"<tool_call>.*?(</tool_call>|\Z)", lambda m: " " * len(m.group(0)), text, flags=re.DOTALL
        )
    if "code" in formats:
        found.append(parse_code_blocks(remaining))
    if "json" in formats and not any(p.attempted for p in found):
        found.append(parse_json_calls(text))
    calls = sorted((c for p in found for c in p.calls), key=lambda c: c.start)
    errors = sorted((e for p in found for e in p.errors), key=lambda e: e.start)
    if len(calls) > MAX_CALLS_PER_MESSAGE:
        errors.append(
            ParseError(f"at most {MAX_CALLS_PER_MESSAGE} tool calls per message; the rest were ignored")
        )
        calls = calls[:MAX_CALLS_PER_MESSAGE]
    return Parsed(tuple(calls), tuple(errors))


def extract_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` (braces balanced), or None."""
    result = None
    position = 0
    while (start := text.find("\\boxed{", position)) != -1:
        depth, index = 1, start + len("\\boxed{")
        while index < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[index], 0)
            index += 1
        if depth:
            break  # unclosed: the generation was cut off
        result = text[start + len("\\boxed{") : index - 1].strip()
        position = index
    return result


def extract_tag(text: str, tag: str) -> str | None:
    """The content of the last `<tag>...</tag>`, or None."""
    matches = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None
