"""Chat templates: the project's ChatML-with-tools template (the tiny model's) and the bridge between
what a model generates and what any model's own template expects.

`CHATML_TOOLS_TEMPLATE` is the Qwen2.5/Hermes convention: tool schemas go into the system turn inside
<tools></tools>; the assistant calls tools with <tool_call>{"name": ..., "arguments": ...}</tool_call>;
each tool response is wrapped in <tool_response></tool_response>, and consecutive responses share one
user turn. A message's `content` is written verbatim; structured `tool_calls` (an OpenAI-style message)
are written back as compact `<tool_call>` JSON after it, and a `reasoning_content` as a `<think>` block
before it, so the messages `assistant_message` makes render back to exactly the text they came from.

`assistant_message(text)` turns generated text into the message a model's own template expects
(Qwen2.5/Qwen3 want structured `tool_calls`; Qwen3 takes `reasoning_content`): the rollout driver
renders the turns after it with it, and an OpenAI-compatible server answers with it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from pacerl.envs.parsing import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    parse_hermes,
    parse_json_calls,
)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

CHATML_TOOLS_TEMPLATE = r"""
{%- if messages and messages[0].role == 'system' %}
    {%- set system = messages[0].content %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set system = '' %}
    {%- set rest = messages %}
{%- endif %}
{%- if system or tools %}
    {{- '<|im_start|>system\n' + system }}
    {%- if tools %}
        {%- if system %}{{- '\n\n' }}{%- endif %}
        {{- '# Tools\n\nYou may call one or more functions. ' }}
        {{- 'Their signatures are within <tools></tools>:\n<tools>' }}
        {%- for tool in tools %}
            {{- '\n' + (tool | tojson) }}
        {%- endfor %}
        {{- '\n</tools>\n\nFor each call, answer with a JSON object within <tool_call></tool_call> tags:\n' }}
        {{- '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in rest %}
    {%- if message.role == 'tool' %}
        {%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.reasoning_content is string %}
            {{- '<think>' + message.reasoning_content + '</think>' }}
        {%- endif %}
        {{- message.content or '' }}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function or call %}
            {%- if (loop.first and message.content) or not loop.first %}{{- '\n' }}{%- endif %}
            {%- set arguments = call.arguments if call.arguments is string else (call.arguments | tojson) %}
            {{- '<tool_call>{"name": ' + (call.name | tojson) }}
            {{- ', "arguments": ' + arguments + '}</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

_HERMES_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def takes_reasoning(chat_template: str | None) -> bool:
    """Whether a template reads an assistant message's `reasoning_content` (Qwen3, DeepSeek-R1 style);
    for one that does not, a `<think>` block stays in the content, where the template writes it."""
    return bool(chat_template) and "reasoning_content" in str(chat_template)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """`(reasoning, answer)`: the text of a leading `<think>...</think>` block (None without one) and
    what follows it, both as generated (newlines kept). A block that never closes is all reasoning."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        body = stripped[len(THINK_OPEN) :]
        if THINK_CLOSE not in body:
            return body, ""
        reasoning, _, answer = body.partition(THINK_CLOSE)
        return reasoning, answer
    if (
        THINK_CLOSE in text
    ):  # the template opened the block in the prompt (`<|im_start|>assistant\n<think>\n`)
        reasoning, _, answer = text.partition(THINK_CLOSE)
        return reasoning, answer
    return None, text


def assistant_message(text: str, *, reasoning_field: bool = True) -> dict[str, Any]:
    """The assistant message a model's own chat template expects for generated `text` (end-of-turn
    token already removed): `{"role": "assistant", "content": ...}` plus, when present,
    `tool_calls` (OpenAI shape, `arguments` parsed into a dict) and `reasoning_content`.

    - Tool calls: Hermes/Qwen `<tool_call>{json}</tool_call>` blocks anywhere in the answer, or an
      answer that is one Llama 3.x call (`{"name": ..., "parameters": ...}`, optionally after
      `<|python_tag|>`) or a Mistral `[TOOL_CALLS][...]` list. Well-formed calls leave the content
      (which is then stripped); a malformed block stays in it as text, for the env to report.
    - Reasoning: with `reasoning_field`, a leading `<think>...</think>` block becomes
      `reasoning_content` (as generated, newlines kept; templates strip what they want) and the
      content is what follows; without it (a template that does not read the field) the block stays
      in the content. Calls are only looked for outside the reasoning.

    Without calls or reasoning the message is `{"role": "assistant", "content": text}`, unchanged. No
    `tool_calls` key is set when there are none: Llama 3.x templates test for the key itself."""
    reasoning, answer = split_reasoning(text)
    calls, content = _calls_in(answer)
    if reasoning is not None and not reasoning_field:
        kept = text[: len(text) - len(answer)]  # the reasoning block exactly as generated
        content = kept + content if calls else text
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None and reasoning_field:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls
        ]
    return message


def _calls_in(answer: str) -> tuple[list[tuple[str, dict[str, Any]]], str]:
    """The well-formed calls in `answer` and the answer without them (stripped when any were found)."""
    calls: list[tuple[str, dict[str, Any]]] = []
    kept: list[str] = []
    position = 0
    for match in _HERMES_BLOCK.finditer(answer):
        parsed = parse_hermes(match.group(0))
        if len(parsed.calls) == 1 and not parsed.errors:
            calls.append((parsed.calls[0].name, parsed.calls[0].arguments))
            kept.append(answer[position : match.start()])
            position = match.end()
    if calls:
        kept.append(answer[position:])
        return calls, "".join(kept).strip()
    parsed = parse_json_calls(answer)
    if parsed.calls and not parsed.errors:
        return [(call.name, call.arguments) for call in parsed.calls], ""
    return [], answer


# -- templates without tool support ---------------------------------------------------------------------

TOOLS_IN_SYSTEM = (
    "# Tools\n\nYou may call one or more functions. Their signatures are within <tools></tools>:\n<tools>"
    "{schemas}\n</tools>\n\nFor each call, answer with a JSON object within <tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""The tools block a template without tool support gets in its system message: the words of
`CHATML_TOOLS_TEMPLATE` (Qwen2.5/Hermes), one JSON schema per line in place of `{schemas}`."""

_PROBE_NAME = "pacerl_probe_tool_7f3a"
_SENTINEL_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": _PROBE_NAME,
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}
_TOOL_SUPPORT: dict[str, bool] = {}


def renders_tools(tokenizer: Any) -> bool:
    """Whether `tokenizer`'s chat template writes the `tools` it is given (rendered once with a probe
    tool whose name must appear; a template that fails on it has no tool support). Cached per template."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return False
    if template not in _TOOL_SUPPORT:
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tools=[_SENTINEL_TOOL], tokenize=False
            )
        except Exception:  # any template error means it cannot take tools
            text = ""
        _TOOL_SUPPORT[template] = isinstance(text, str) and _PROBE_NAME in text
    return _TOOL_SUPPORT[template]


def tools_in_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with `tools` written into them for a template without tool support, in the one
    format of `CHATML_TOOLS_TEMPLATE`: the tools block (`TOOLS_IN_SYSTEM`) ends the system message (a new
    one when there is none), an assistant message's structured `tool_calls` are written after its content
    as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, and tool results become one user turn
    per run of consecutive `tool` messages, each wrapped in `<tool_response></tool_response>`."""
    block = TOOLS_IN_SYSTEM.format(
        schemas="".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    )
    if messages and messages[0].get("role") == "system":
        system = str(messages[0].get("content") or "")
        head = [{"role": "system", "content": f"{system}\n\n{block}" if system else block}]
        rest = messages[1:]
    else:
        head, rest = [{"role": "system", "content": block}], messages
    out: list[dict[str, Any]] = list(head)
    for message in rest:
        role = message.get("role")
        if role == "tool":
            response = "\n<tool_response>\n" + str(message.get("content") or "") + "\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + response}
            else:
                out.append({"role": "user", "content": response.removeprefix("\n"), "_tool_results": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            text = str(message.get("content") or "")
            for call in message["tool_calls"]:
                function = call.get("function", call)
                arguments = function["arguments"]
                arguments = (
                    arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
                )
                written = (
                    '<tool_call>{"name": '
                    + json.dumps(function["name"], ensure_ascii=False)
                    + ', "arguments": '
                    + arguments
                    + "}</tool_call>"
                )
                text = f"{text}\n{written}" if text else written
            message = {key: value for key, value in message.items() if key != "tool_calls"} | {
                "content": text
            }
        out.append(message)
    return [{k: v for k, v in message.items() if k != "_tool_results"} for message in out]


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    *,
    generation_prompt: bool,
) -> str:
    """`tokenizer.apply_chat_template(messages, tools=tools)` as text; a template that cannot write
    tools gets them in the messages instead (`tools_in_messages`), so every checkpoint sees its tools
    and calls them in a format the envs parse."""
    listed = list(messages)
    schemas = list(tools) if tools else None
    if schemas and not renders_tools(tokenizer):
        listed, schemas = tools_in_messages(listed, schemas), None
    text = tokenizer.apply_chat_template(
        listed, tools=schemas, tokenize=False, add_generation_prompt=generation_prompt
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) gave a {type(text).__name__}")
    return text
