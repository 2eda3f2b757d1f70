"""Real model families' chat templates through the rollout driver: Qwen2.5-Instruct, Qwen3 and Llama 3.1
templates (tests/fixtures/templates) on small tokenizers trained offline with each family's special
tokens. A record holds exactly the generated tokens plus the template's turns; tools render the way
each template renders them; `<think>` and structured tool calls go to the template as it expects."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from pacerl.agents.engine.protocol import FinishReason, Generation, SamplingParams
from pacerl.agents.models import TinyMoEConfig, build_tiny_moe, save_model
from pacerl.agents.rollout import RolloutConfig, RolloutDriver
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.agents.trajectory import Origin, Status, Trajectory
from pacerl.assembly import load_policy
from pacerl.config import config_from_dict
from pacerl.envs import Task
from pacerl.envs.chat_template import CHATML_TOOLS_TEMPLATE, assistant_message
from pacerl.envs.code_math import CodeMathEnv
from pacerl.envs.parsing import Parsed, ToolCall
from tests.agents.helpers import FAMILIES, family_tokenizer
from tests.scripted import ScriptedEngineBase

TASK = Task("t1", "What is 123 * 45?", ("5535",))
QWEN_CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(123 * 45)"}}\n</tool_call>'


class ScriptedEngine(ScriptedEngineBase):
    """Plays fixed assistant turns; token i of a call gets log-prob -(i + 1) / 100, so alignment shows."""

    def __init__(self, tokenizer: Any, turns: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.calls: list[list[int]] = []

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, request_id: str | None = None,
        return_routed_experts: bool = False, session: str | None = None,
    ) -> Generation:  # fmt: skip
        self.calls.append(list(input_ids))
        tokens = self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False)
        logprobs = tuple(-(i + 1) / 100 for i in range(len(tokens)))
        return Generation(tuple(tokens), logprobs, (self._version,) * len(tokens), FinishReason.STOP)


async def play(
    tokenizer: Any, turns: Sequence[str], make_env: Any = None
) -> tuple[Trajectory, RolloutDriver]:
    engine = ScriptedEngine(tokenizer, turns)
    make_env = make_env or (lambda: CodeMathEnv(tasks=[TASK]))
    driver = RolloutDriver(engine, tokenizer, make_env, RolloutConfig(group_size=1, max_total_tokens=4096))
    (trajectory,) = await driver.rollout_group(TASK)
    assert not engine.turns, "every scripted turn was played"
    return trajectory, driver


def text_of(tokenizer: Any, tokens: Iterable[int]) -> str:
    text: str = tokenizer.decode(list(tokens), skip_special_tokens=False)
    return text


def segments(tokenizer: Any, trajectory: Trajectory) -> list[tuple[str, str]]:
    return [(s.origin.value, text_of(tokenizer, s.tokens)) for s in trajectory.segments]


def check_model_tokens(tokenizer: Any, trajectory: Trajectory, turns: Sequence[str]) -> None:
    """The model segments are exactly the generated tokens with their log-probs, and only they train."""
    model = [s for s in trajectory.segments if s.origin is Origin.MODEL]
    assert [list(s.tokens) for s in model] == [tokenizer.encode(t, add_special_tokens=False) for t in turns]
    assert [list(s.logprobs or ()) for s in model] == [
        pytest.approx([-(i + 1) / 100 for i in range(len(s.tokens))]) for s in model
    ]
    mask = trajectory.loss_mask
    assert mask.sum() == sum(len(s.tokens) for s in model)
    flat = [t for s in trajectory.segments for t in s.tokens]
    trained = [t for t, m in zip(flat, mask, strict=True) if m]
    assert trained == [t for s in model for t in s.tokens]


def conversation(tools_turns: Sequence[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The env's messages and tool outputs for `tools_turns` played by hand (the expected transcript)."""
    env = CodeMathEnv(tasks=[TASK])
    observation, _ = env.reset(options={"task": TASK})
    messages: list[dict[str, Any]] = list(observation)
    for turn in tools_turns:
        tool_messages, *_ = env.step(turn)
        messages += [assistant_message(turn), *tool_messages]
    tools = env.tool_schemas()
    env.close()
    return messages, tools


# -- Qwen2.5-Instruct ----------------------------------------------------------------------------------


async def test_qwen25_episode_records_generated_tokens_and_the_templates_turns() -> None:
    tokenizer = family_tokenizer("qwen2.5")
    turns = [QWEN_CALL + "<|im_end|>", "The product is \\boxed{5535}.<|im_end|>"]
    trajectory, driver = await play(tokenizer, turns)
    assert trajectory.status is Status.COMPLETED and trajectory.reward == 1.0
    check_model_tokens(tokenizer, trajectory, turns)
    messages, tools = conversation([QWEN_CALL])
    (_, prompt), _, (tool_origin, tool_turn), _ = segments(tokenizer, trajectory)
    # Tools sit in the system turn, as Qwen2.5 writes them, each schema one JSON line.
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou solve math problems.")
    assert "# Tools\n\nYou may call one or more functions to assist with the user query." in system
    assert f"<tools>\n{json.dumps(tools[0])}\n</tools>" in system
    assert prompt.endswith("<|im_start|>user\nWhat is 123 * 45?<|im_end|>\n<|im_start|>assistant\n")
    assert (tool_origin, tool_turn) == (
        "tool",
        f"\n<|im_start|>user\n<tool_response>\n{messages[-1]['content']}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
    )
    # The model wrote its call the way the template writes a structured one: the whole record is the
    # template's rendering of the conversation (minus the newline after the last turn, never generated).
    final = assistant_message("The product is \\boxed{5535}.")
    rendered = tokenizer.apply_chat_template([*messages, final], tools=tools, tokenize=False)
    assert text_of(tokenizer, trajectory.tokens) + "\n" == rendered
    assert driver.counts["assistant_rerendered"] == 0


async def test_qwen25_gets_structured_tool_calls_not_call_text() -> None:
    tokenizer = family_tokenizer("qwen2.5")
    compact = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    message = assistant_message("Let me run it.\n" + compact)
    assert message == {
        "role": "assistant",
        "content": "Let me run it.",
        "tool_calls": [
            {"type": "function", "function": {"name": "python", "arguments": {"code": "print(1)"}}}
        ],
    }
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, message], tokenize=False)
    assert rendered.endswith(
        '<|im_start|>assistant\nLet me run it.\n<tool_call>\n{"name": "python", "arguments": {"code": '
        '"print(1)"}}\n</tool_call><|im_end|>\n'
    )


# -- Qwen3 ---------------------------------------------------------------------------------------------


async def test_qwen3_multi_turn_with_and_without_think_never_renders_differently() -> None:
    tokenizer = family_tokenizer("qwen3")
    thought = "<think>\nI should compute it exactly.\n</think>\n\n"
    second = QWEN_CALL.replace("123 * 45", "5535 + 0")
    turns = [
        thought + QWEN_CALL + "<|im_end|>",
        second + "<|im_end|>",  # no reasoning: Qwen3 writes this turn differently once it is not last
        "<think>\nBoth agree.\n</think>\n\nThe product is \\boxed{5535}.<|im_end|>",
    ]
    trajectory, driver = await play(tokenizer, turns)
    assert trajectory.status is Status.COMPLETED and trajectory.reward == 1.0, trajectory.status_reason
    check_model_tokens(tokenizer, trajectory, turns)
    assert driver.counts["assistant_rerendered"] == 1  # the turn without reasoning, and only it
    messages, tools = conversation([thought + QWEN_CALL, second])
    origins = [origin for origin, _ in segments(tokenizer, trajectory)]
    assert origins == ["prompt", "model", "tool", "model", "tool", "model"]
    tool_turns = [text for origin, text in segments(tokenizer, trajectory) if origin == "tool"]
    outputs = [m["content"] for m in messages if m["role"] == "tool"]
    assert tool_turns == [
        f"\n<|im_start|>user\n<tool_response>\n{out}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        for out in outputs
    ]
    # Reasoning went to the template as `reasoning_content`, and Qwen3 keeps it within one user query
    # (multi-step tool use): the record equals the template's own rendering of the whole episode.
    assert messages[2]["reasoning_content"] == "\nI should compute it exactly.\n"
    assert messages[2]["content"] == ""
    final = assistant_message("<think>\nBoth agree.\n</think>\n\nThe product is \\boxed{5535}.")
    rendered = tokenizer.apply_chat_template([*messages, final], tools=tools, tokenize=False)
    assert text_of(tokenizer, trajectory.tokens) + "\n" == rendered
    # What the model saw at each turn is the record's prefix: the tokens it generated, never rewritten.
    prompt_turn_2 = driver.engine.calls[1]  # type: ignore[attr-defined]
    assert prompt_turn_2 == list(trajectory.tokens[: len(prompt_turn_2)])


async def test_qwen3_the_env_acts_on_the_answer_not_on_the_reasoning() -> None:
    tokenizer = family_tokenizer("qwen3")
    # A call inside <think> is a thought, not a call: the env scores the answer after it.
    turns = ["<think>\nMaybe " + QWEN_CALL + "?\n</think>\n\nIt is \\boxed{5535}.<|im_end|>"]
    trajectory, _ = await play(tokenizer, turns)
    assert trajectory.status is Status.COMPLETED and trajectory.reward == 1.0
    assert [s.origin for s in trajectory.segments] == [Origin.PROMPT, Origin.MODEL]


# -- Llama 3.1 -----------------------------------------------------------------------------------------


class LlamaCodeMath(CodeMathEnv):
    """CodeMath reading Llama 3.x calls (a bare JSON object) through `assistant_message`."""

    def parse(self, action: str) -> Parsed:
        calls = assistant_message(action).get("tool_calls", [])
        found = tuple(ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in calls)
        return Parsed(found) if found else super().parse(action)


async def test_llama31_tools_in_the_first_user_turn_and_ipython_results() -> None:
    tokenizer = family_tokenizer("llama3.1")
    call = '{"name": "python", "parameters": {"code": "print(123 * 45)"}}'
    turns = [call + "<|eot_id|>", "The product is \\boxed{5535}.<|eot_id|>"]
    trajectory, driver = await play(tokenizer, turns, lambda: LlamaCodeMath(tasks=[TASK]))
    assert trajectory.status is Status.COMPLETED and trajectory.reward == 1.0, trajectory.status_reason
    check_model_tokens(tokenizer, trajectory, turns)
    env = LlamaCodeMath(tasks=[TASK])
    observation, _ = env.reset(options={"task": TASK})
    tool_messages, *_ = env.step(call)
    tools = env.tool_schemas()
    env.close()
    (_, prompt), _, (_, tool_turn), _ = segments(tokenizer, trajectory)
    assert prompt.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    )
    user = prompt.split("<|start_header_id|>user<|end_header_id|>\n\n")[1]
    assert user.startswith("Given the following functions, please respond with a JSON for a function call")
    assert json.dumps(tools[0], indent=4) + "\n\nWhat is 123 * 45?<|eot_id|>" in user
    # Llama 3.1's template writes a string result as JSON (a string is iterable in Jinja).
    assert tool_turn == (
        f"<|start_header_id|>ipython<|end_header_id|>\n\n{json.dumps(tool_messages[0]['content'])}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    messages = [
        *observation,
        assistant_message(call),
        *tool_messages,
        assistant_message("The product is \\boxed{5535}."),
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text_of(tokenizer, trajectory.tokens) == rendered
    assert driver.counts["assistant_rerendered"] == 0


# -- assistant_message ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("plain answer", {"role": "assistant", "content": "plain answer"}),
        (
            '{"name": "search", "parameters": {"query": "x"}}',
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "search", "arguments": {"query": "x"}}}
                ],
            },
        ),
        (
            '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": 1}}]',
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "a", "arguments": {}}},
                    {"type": "function", "function": {"name": "b", "arguments": {"k": 1}}},
                ],
            },
        ),
        ('{"name": "Paris"}', {"role": "assistant", "content": '{"name": "Paris"}'}),
        (
            "Try <tool_call>not json</tool_call>",  # malformed: stays text, for the env to report
            {"role": "assistant", "content": "Try <tool_call>not json</tool_call>"},
        ),
        (
            "<think>a</think>\n\nb",
            {"role": "assistant", "content": "\n\nb", "reasoning_content": "a"},
        ),
        (
            "half a thought</think>b",
            {"role": "assistant", "content": "b", "reasoning_content": "half a thought"},
        ),
    ],
)
def test_assistant_message(text: str, expected: dict[str, Any]) -> None:
    assert assistant_message(text) == expected


def test_a_template_without_a_reasoning_field_keeps_think_in_the_content() -> None:
    text = '<think>a</think><tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert assistant_message(text, reasoning_field=False) == {
        "role": "assistant",
        "content": "<think>a</think>",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
    }


def test_the_projects_template_writes_structured_messages_back_verbatim() -> None:
    tokenizer = tiny_tokenizer()
    for text in (
        '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>',
        'Run it.\n<tool_call>{"name": "python", "arguments": {"code": "x = 1"}}</tool_call>',
        "<think>let me see</think>The answer is \\boxed{2}.",
    ):
        structured = [{"role": "user", "content": "q"}, assistant_message(text)]
        plain = [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]
        assert tokenizer.apply_chat_template(structured, tokenize=False) == tokenizer.apply_chat_template(
            plain, tokenize=False
        )


# -- a Hugging Face checkpoint with its own tokenizer ----------------------------------------------------


async def test_a_checkpoints_own_template_renders_the_envs_tools(tmp_path: Path) -> None:
    tokenizer = family_tokenizer("qwen2.5")
    save_model(build_tiny_moe(TinyMoEConfig(), tokenizer), tokenizer, tmp_path / "qwen")
    config = config_from_dict(
        {"model": {"path": str(tmp_path / "qwen")}, "env": {"id": "pacerl/CodeMath-v0"}}
    )
    _, loaded = load_policy(config)
    assert loaded.chat_template == FAMILIES["qwen2.5"].chat_template
    engine = ScriptedEngine(loaded, ["\\boxed{5535}<|im_end|>"])
    rollout = RolloutConfig(group_size=1, tool_schemas_in_prompt=True)
    driver = RolloutDriver(engine, loaded, lambda: CodeMathEnv(tasks=[TASK]), rollout)
    await driver.rollout_group(TASK)
    prompt = text_of(loaded, engine.calls[0])
    schema = json.dumps(CodeMathEnv(tasks=[TASK]).tool_schemas()[0])
    assert (
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{schema}"
        in prompt
    )


async def test_a_checkpoint_without_a_template_gets_the_projects(tmp_path: Path) -> None:
    tokenizer = family_tokenizer("qwen2.5")
    directory = save_model(build_tiny_moe(TinyMoEConfig(), tokenizer), tokenizer, tmp_path / "base")
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    for extra in directory.glob("chat_template.*"):
        extra.unlink()
    config = config_from_dict({"model": {"path": str(directory)}, "env": {"id": "pacerl/CodeMath-v0"}})
    _, loaded = load_policy(config)
    assert loaded.chat_template == CHATML_TOOLS_TEMPLATE
