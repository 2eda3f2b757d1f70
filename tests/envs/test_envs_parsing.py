"""Tool-call parsing and answer extraction: real formats, malformed output, and fuzzing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pacerl.envs.parsing import (
    MAX_CALL_CHARS,
    MAX_CALLS_PER_MESSAGE,
    extract_boxed,
    extract_tag,
    parse_actions,
    parse_code_blocks,
    parse_hermes,
)


def call(name: str, arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_several_hermes_calls_in_order() -> None:
    text = f"Let me compute.\n{call('python', {'code': 'print(1)'})}\nand\n{call('search', {'query': 'x'})}"
    parsed = parse_hermes(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("python", {"code": "print(1)"}),
        ("search", {"query": "x"}),
    ]
    assert parsed.errors == ()


def test_arguments_as_a_json_string_and_missing_arguments() -> None:
    encoded = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}</tool_call>'
    assert parse_hermes(encoded).calls[0].arguments == {"code": "1"}
    assert parse_hermes('<tool_call>{"name": "now"}</tool_call>').calls[0].arguments == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('<tool_call>{"name": "python", "arguments": {"code": "1"}', "never closed"),
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": "python", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "python", "arguments": "nope"}</tool_call>', "not a JSON object"),
        ("<tool_call><tool_call>{}</tool_call></tool_call>", "cannot be nested"),
        ("stray </tool_call> here", "without a matching"),
        (
            "<tool_call>"
            + '{"name": "p", "arguments": {"code": "'
            + "x" * MAX_CALL_CHARS
            + '"}}</tool_call>',
            "at most",
        ),
        ("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>", "not valid JSON"),
    ],
)
def test_malformed_calls_become_readable_errors(text: str, message: str) -> None:
    parsed = parse_hermes(text)
    assert parsed.attempted
    assert any(message in e.message for e in parsed.errors), parsed


def test_fenced_code_blocks() -> None:
    text = "First:\n```python\nx = 2\nprint(x)\n```\nthen\n```py\nprint(x * 3)\n```\n```bash\nls\n```"
    parsed = parse_code_blocks(text)
    assert [c.arguments["code"] for c in parsed.calls] == ["x = 2\nprint(x)\n", "print(x * 3)\n"]
    unclosed = parse_code_blocks("```python\nprint(1)")
    assert unclosed.calls == () and "never closed" in unclosed.errors[0].message


def test_both_formats_merge_in_text_order_without_double_counting() -> None:
    inner = call("python", {"code": "```python\nprint(0)\n```"})
    text = f"```python\nprint(1)\n```\n{inner}\n```python\nprint(2)\n```"
    parsed = parse_actions(text)
    assert [c.arguments["code"] for c in parsed.calls] == [
        "print(1)\n",
        "```python\nprint(0)\n```",
        "print(2)\n",
    ]
    assert parse_actions(text, ("hermes",)).calls[0].name == "python"
    with pytest.raises(ValueError, match="unknown tool-call format"):
        parse_actions(text, ("xml",))


def test_too_many_calls_are_capped() -> None:
    parsed = parse_actions(
        "".join(call("python", {"code": str(i)}) for i in range(MAX_CALLS_PER_MESSAGE + 3))
    )
    assert len(parsed.calls) == MAX_CALLS_PER_MESSAGE
    assert any("at most" in e.message for e in parsed.errors)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{ 7 }", "7"),
        ("\\boxed{unclosed", None),
        ("no answer", None),
        ("\\boxed{3} and \\boxed{4", "3"),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


def test_extract_tag() -> None:
    assert extract_tag("<answer>a</answer> <answer> Paris </answer>", "answer") == "Paris"
    assert extract_tag("<answer>open", "answer") is None


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=400))
def test_parser_never_raises_on_arbitrary_text(text: str) -> None:
    parsed = parse_actions(text)
    assert all(isinstance(c.arguments, dict) for c in parsed.calls)
    extract_boxed(text)
    extract_tag(text, "answer")


fragments = st.sampled_from(
    ["<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', ":", ",", '"python"', "```python\n",
     "```", "\\boxed{", "[", "]", "null", "\x00", "\ud7ff", " ", "\n", '"code"', '"print(1)"']
)  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(st.lists(fragments, max_size=40).map("".join))
def test_parser_never_raises_on_tag_soup(text: str) -> None:
    parsed = parse_actions(text)
    for found in parsed.calls:
        assert isinstance(found.name, str) and found.name


def test_whole_message_json_calls_of_llama_and_mistral() -> None:
    llama = parse_actions('{"name": "python", "parameters": {"code": "print(6 * 7)"}}')
    assert [(c.name, c.arguments) for c in llama.calls] == [("python", {"code": "print(6 * 7)"})]
    tagged = parse_actions('<|python_tag|>{"name": "search", "parameters": {"query": "Paris"}}')
    assert [(c.name, c.arguments) for c in tagged.calls] == [("search", {"query": "Paris"})]
    mistral = parse_actions(
        '[TOOL_CALLS][{"name": "python", "arguments": {"code": "1"}}, {"name": "python", "arguments": "{}"}]'
    )
    assert [(c.name, c.arguments) for c in mistral.calls] == [("python", {"code": "1"}), ("python", {})]
    # a JSON answer is not a call; a marker followed by anything else is a call gone wrong
    assert not parse_actions('{"name": "Paris"}').attempted
    assert not parse_actions('The answer is {"name": "x", "parameters": {}}').attempted
    broken = parse_actions("[TOOL_CALLS] python(1)")
    assert not broken.calls and "[TOOL_CALLS] must be followed by a JSON list" in broken.errors[0].message
    assert "must be a JSON object" in parse_actions('{"name": "python", "parameters": [1]}').errors[0].message
    # with a <tool_call> block present, only that format counts; without `json` nothing is read
    mixed = parse_actions('<tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert [c.name for c in mixed.calls] == ["a"]
    assert not parse_actions('{"name": "python", "parameters": {}}', ("hermes", "code")).attempted
