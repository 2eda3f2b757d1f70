"""Checkpoints whose chat template cannot write tools (SmolLM2-135M-Instruct's plain ChatML): the tools go
into the system message and calls and results into the turns, in the one format of the project's
ChatML-with-tools template, so such a model is prompted, demonstrated to and parsed like the tiny one."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pacerl.agents.rollout import RolloutConfig, RolloutDriver
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.agents.trajectory import Status
from pacerl.envs import Task
from pacerl.envs.chat_template import TOOLS_IN_SYSTEM, render_chat, renders_tools, tools_in_messages
from pacerl.envs.code_math import CodeMathEnv
from pacerl.trainer.sft import demonstrations
from tests.agents.helpers import ScriptedEngine

PLAIN_CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""SmolLM2-135M-Instruct's template (its default system line shortened): no `tools` anywhere."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run code — quickly",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    }
]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {
        "role": "assistant",
        "content": "Let me run it.",
        "tool_calls": [
            {"type": "function", "function": {"name": "python", "arguments": {"code": "print(2+2)"}}}
        ],
    },
    {"role": "tool", "content": "4"},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "4"},
]
TASK = Task("t1", "What is 123 * 45?", ("5535",))
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(123 * 45)"}}</tool_call>'


@pytest.fixture(scope="module")
def tools_template() -> Any:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def plain() -> Any:
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = PLAIN_CHATML
    return tokenizer


def test_tool_support_is_probed_by_rendering(tools_template: Any, plain: Any) -> None:
    assert renders_tools(tools_template) and not renders_tools(plain)
    raising = copy.deepcopy(plain)
    raising.chat_template = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}" + PLAIN_CHATML
    assert not renders_tools(raising)  # a template that refuses tools has no tool support
    mentioning = copy.deepcopy(plain)
    mentioning.chat_template = "{# tools are not supported #}" + PLAIN_CHATML
    assert not renders_tools(mentioning)  # the word in the template is no support


def test_a_tool_less_template_renders_what_the_tools_template_renders(
    tools_template: Any, plain: Any
) -> None:
    """Both are ChatML: written into the messages, the tools, calls and results come out exactly as the
    project's ChatML-with-tools template writes them from `tools=`."""
    for generation_prompt in (True, False):
        expected = render_chat(tools_template, CONVERSATION, TOOLS, generation_prompt=generation_prompt)
        assert render_chat(plain, CONVERSATION, TOOLS, generation_prompt=generation_prompt) == expected
    text = render_chat(plain, CONVERSATION, TOOLS, generation_prompt=True)
    assert "Run code — quickly" in text  # the schema verbatim, not \\u-escaped
    assert (
        'Let me run it.\n<tool_call>{"name": "python", "arguments": {"code": "print(2+2)"}}</tool_call>'
        in text
    )
    assert (
        "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\nok\n</tool_response>"
        in text
    )
    # no system message: the tools block is one of its own (the template's default line is then not written)
    bare = render_chat(plain, CONVERSATION[1:], TOOLS, generation_prompt=False)
    assert bare.startswith("<|im_start|>system\n# Tools\n\nYou may call") and "helpful AI" not in bare
    assert render_chat(plain, CONVERSATION[1:2], None, generation_prompt=True).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant"
    )  # without tools, nothing changes


def test_tools_in_messages_by_hand() -> None:
    messages = tools_in_messages([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}], TOOLS)
    block = TOOLS_IN_SYSTEM.format(
        schemas='\n{"type": "function", "function": {"name": "python", "description": "Run code — quickly", '
        '"parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}'
    )
    assert messages == [
        {"role": "system", "content": block},
        {"role": "user", "content": "q"},
        {"role": "user", "content": "<tool_response>\nr\n</tool_response>"},
    ]
    string_arguments = tools_in_messages(
        [{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": '{"x": 1}'}]}], TOOLS
    )
    assert string_arguments[1] == {
        "role": "assistant",
        "content": '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
    }


async def test_an_episode_with_a_tool_less_template_calls_its_tool(plain: Any) -> None:
    """The prompt carries the tools block; the model's call is parsed and run, its result comes back as
    a tool-response turn, and the record decodes to exactly the rendered conversation."""
    engine = ScriptedEngine(plain, [CALL, "The product is \\boxed{5535}.<|im_end|>"])
    driver = RolloutDriver(engine, plain, lambda: CodeMathEnv(tasks=[TASK]), RolloutConfig(group_size=1))
    (trajectory,) = await driver.rollout_group(TASK)
    assert trajectory.status is Status.COMPLETED and trajectory.reward == 1.0
    text = plain.decode(list(trajectory.tokens), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and '"name": "python"' in text.split("<|im_end|>")[0]
    assert (
        "<|im_start|>user\n<tool_response>\n5535\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    )
    env = CodeMathEnv(tasks=[TASK])
    observation, _ = env.reset(options={"task": TASK})
    tool_messages, *_ = env.step(CALL)
    tools = env.tool_schemas()
    env.close()
    conversation = [
        *observation,
        {"role": "assistant", "content": CALL},
        *tool_messages,
        {"role": "assistant", "content": "The product is \\boxed{5535}."},
    ]
    # the template's newline after the final <|im_end|> is never generated
    assert text + "\n" == render_chat(plain, conversation, tools, generation_prompt=False)


def test_demonstrations_for_a_tool_less_template_teach_the_call_text(plain: Any) -> None:
    (demo,) = demonstrations("pacerl/CodeMath-v0", [TASK], tokenizer=plain, tool_schemas=True)
    trained = plain.decode(
        [t for t, m in zip(demo.tokens, demo.loss_mask, strict=True) if m], skip_special_tokens=False
    )
    assert '<tool_call>{"name": "python", "arguments": {"code": ' in trained  # the call is in the loss
    prompt = plain.decode(list(demo.tokens), skip_special_tokens=False).split("<|im_end|>")[0]
    assert "# Tools" in prompt and '"name": "python"' in prompt
