"""The tool envs: Gymnasium's checker over the registry, scripted episodes, limits and bad input."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pacerl import envs
from pacerl.envs import Task, ToolEnvConfig, load_tasks
from pacerl.envs.code_math import CodeMathEnv
from pacerl.envs.math import MathEnv
from pacerl.envs.tools import ToolContext, ToolError, get_tool
from tests.helpers import TAKEOVER

TASK = Task("t1", "What is 123 * 45?", ("5535",), 1)


def python_call(code: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>"


@pytest.mark.parametrize("env_id", envs.ENV_IDS)
def test_every_registered_env_passes_gymnasiums_checker(env_id: str) -> None:
    env = gymnasium.make(env_id)
    try:
        check_env(env.unwrapped, skip_render_check=False)
    finally:
        env.close()


def test_registry_ids_are_versioned() -> None:
    registered = {env_id for env_id in gymnasium.registry if env_id.startswith("pacerl/")}
    assert registered == set(envs.ENV_IDS)
    assert all(env_id.endswith("-v0") for env_id in registered)


def test_codemath_solved_with_a_tool_call() -> None:
    env = gymnasium.make("pacerl/CodeMath-v0")
    observation, info = env.reset(options={"task": TASK})
    assert [m["role"] for m in observation] == ["system", "user"] and observation[1][
        "content"
    ] == TASK.question
    assert info["task_id"] == "t1" and info["tools"] == ["python"]
    observation, reward, terminated, truncated, info = env.step(
        "Compute it.\n" + python_call("print(123 * 45)")
    )
    assert observation == ({"role": "tool", "name": "python", "content": "5535"},)
    assert (reward, terminated, truncated, info["tool_calls"], info["error"]) == (0.0, False, False, 1, False)
    observation, reward, terminated, truncated, info = env.step("So the answer is \\boxed{5535}.")
    assert (observation, reward, terminated, truncated) == ((), 1.0, True, False)
    assert info["reward_breakdown"] == {"total": 1.0, "correctness": 1.0, "format": 1.0}
    env.close()


def test_codemath_variables_survive_between_turns_and_code_blocks_work() -> None:
    env = CodeMathEnv(tasks=[TASK])
    env.reset()
    assert env.sandbox_sessions_open == 0  # the sandbox starts lazily
    env.step("```python\nproduct = 123 * 45\n```")
    assert env.sandbox_sessions_open == 1
    observation, *_ = env.step(python_call("print(product + 1)"))
    assert observation[0]["content"] == "5536"
    _, reward, terminated, *_ = env.step("\\boxed{5536}")
    assert (reward, terminated) == (0.0, True)  # wrong answers get nothing
    assert env.sandbox_sessions_open == 0  # released when the episode ends
    env.close()
    env.close()  # idempotent


def test_wrong_unformatted_and_equivalent_answers() -> None:
    env = CodeMathEnv(
        tasks=[Task("half", "What is 1/2?", ("\\frac{1}{2}",))], config=ToolEnvConfig(format_weight=0.1)
    )
    for message, reward in [("\\boxed{0.5}", 1.0), ("\\boxed{1/3}", 0.1), ("one half", 0.0)]:
        env.reset()
        assert env.step(message)[1] == pytest.approx(reward), message
    env.close()


@pytest.mark.parametrize(
    ("config", "actions", "reason"),
    [
        (ToolEnvConfig(max_turns=2), [python_call("1"), python_call("2")], "max_turns"),
        (ToolEnvConfig(max_tool_calls=1), [python_call("1"), python_call("2")], "max_tool_calls"),
        (ToolEnvConfig(max_context_chars=600), [python_call("print('x' * 500)")], "context_budget"),
        (ToolEnvConfig(on_tool_error="truncate"), ["<tool_call>{oops</tool_call>"], "tool_error"),
    ],
)
def test_truncation(config: ToolEnvConfig, actions: list[str], reason: str) -> None:
    env = CodeMathEnv(tasks=[TASK], config=config)
    env.reset()
    for action in actions[:-1]:
        assert not env.step(action)[3]
    _, reward, terminated, truncated, info = env.step(actions[-1])
    assert (reward, terminated, truncated, info["truncation_reason"]) == (0.0, False, True, reason)
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("more")
    env.close()


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "unknown tool 'rm'; available: python"),
        (
            '<tool_call>{"name": "python", "arguments": {"cmd": "1"}}</tool_call>',
            "invalid arguments for python",
        ),
        (
            '<tool_call>{"name": "python", "arguments": {"code": 5}}</tool_call>',
            "code: Input should be a valid string",
        ),
        ('<tool_call>{"name": "python"', "never closed"),
        ("<tool_call>\x00\xff\ufffd</tool_call>", "not valid JSON"),
    ],
)
def test_bad_calls_become_observations(action: str, expected: str) -> None:
    env = CodeMathEnv(tasks=[TASK])
    env.reset()
    observation, _, terminated, truncated, info = env.step(action)
    assert expected in observation[0]["content"] and observation[0]["role"] == "tool"
    assert info["error"] and info["tool_errors"] == 1 and not terminated and not truncated
    observation, *_ = env.step(python_call("print('recovered')"))  # the episode goes on
    assert observation[0]["content"] == "recovered"
    env.close()


@pytest.mark.slow
def test_sandbox_failures_are_observations() -> None:
    env = CodeMathEnv(tasks=[TASK])
    env.reset()
    observation, _, _, _, info = env.step(python_call("while True:\n    pass"))
    assert "[timeout:" in observation[0]["content"] and info["error"]
    observation, *_ = env.step(python_call("print('next')"))
    assert observation[0]["content"] == "next"
    env.close()


def test_math_is_single_turn_without_tools() -> None:
    env = gymnasium.make("pacerl/Math-v0")
    _, info = env.reset(seed=3)
    assert info["tools"] == []
    _, _, terminated, truncated, info = env.step(python_call("print(1)") + " \\boxed{0}")
    assert terminated and not truncated and info["tool_calls"] == 0
    env.close()
    solved = MathEnv(tasks=[TASK])
    solved.reset()
    assert solved.step("\\boxed{5535}")[1] == 1.0


def test_reset_is_seeded_and_takes_tasks_by_id() -> None:
    env = CodeMathEnv()
    first = env.reset(seed=7)[1]["task_id"]
    assert env.reset(seed=7)[1]["task_id"] == first
    assert (
        env.reset(options={"task_id": "codemath-forms-train-00003"})[1]["task_id"]
        == "codemath-forms-train-00003"
    )
    assert (
        env.reset(options={"task": {"question": "What is 2+2?", "answer": "4"}})[0][1]["content"]
        == "What is 2+2?"
    )
    with pytest.raises(KeyError, match="no task with id"):
        env.reset(options={"task_id": "missing"})
    env.close()


def test_render_ansi_shows_the_transcript() -> None:
    env = CodeMathEnv(tasks=[TASK], render_mode="ansi")
    env.reset()
    env.step(python_call("print(2)"))
    text = env.render()
    assert text is not None and "[user] What is 123 * 45?" in text and "[tool] 2" in text
    env.close()


async def test_many_episodes_step_concurrently_on_one_loop() -> None:
    tasks = load_tasks("codemath-val")[:16]
    environments = [CodeMathEnv(tasks=[task]) for task in tasks]
    for env in environments:
        env.reset()

    async def play(env: CodeMathEnv, task: Task) -> float:
        expression = task.question.removeprefix("What is ").removesuffix("?")
        observation, *_ = await env.astep(python_call(f"print({expression})"))
        _, reward, terminated, _, _ = await env.astep(f"\\boxed{{{observation[0]['content']}}}")
        assert terminated
        return reward

    rewards = await asyncio.gather(*(play(env, task) for env, task in zip(environments, tasks, strict=True)))
    assert rewards == [1.0] * len(tasks)
    for env in environments:
        env.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=300))
def test_step_never_raises_on_model_output(shared_codemath: CodeMathEnv, text: str) -> None:
    shared_codemath.reset(options={"task": TASK})
    observation, reward, _, _, info = shared_codemath.step(text)
    assert shared_codemath.observation_space.contains(observation)
    assert reward in (0.0, 1.0) and isinstance(info["error"], bool)


@pytest.fixture(scope="module")
def shared_codemath() -> CodeMathEnv:
    env = CodeMathEnv(tasks=[TASK], config=ToolEnvConfig(max_turns=1))
    yield env
    env.close()


def test_task_files_jsonl_parquet_and_errors(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": "a", "question": "Q?", "answer": ["x", "y"], "level": 2, "source": "me"}]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    for name in ("t.jsonl", "t.parquet"):
        (task,) = load_tasks(tmp_path / name)
        assert (task.id, task.answers, task.level, dict(task.metadata)) == (
            "a",
            ("x", "y"),
            2,
            {"source": "me"},
        )
    (tmp_path / "bad.jsonl").write_text('{"question": "Q"}\n')
    with pytest.raises(ValueError, match=r"row 0: 'answer'"):
        load_tasks(tmp_path / "bad.jsonl")
    (tmp_path / "broken.jsonl").write_text("{\n")
    with pytest.raises(ValueError, match=r"broken\.jsonl:1: not JSON"):
        load_tasks(tmp_path / "broken.jsonl")
    assert len(load_tasks("codemath-val")) == 200


def test_huggingface_datasets_path_on_local_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "train.jsonl").write_text(json.dumps({"id": "h1", "question": "Q?", "answer": "1"}) + "\n")
    (task,) = load_tasks(str(tmp_path), split="train")
    assert task.id == "h1" and task.answer == "1"


def test_shipped_files_match_their_generators(tmp_path: Path) -> None:
    from pacerl.envs.tasks import DATA_DIR, write_shipped

    write_shipped(tmp_path)
    for path in sorted(tmp_path.iterdir()):
        assert path.read_text() == (DATA_DIR / path.name).read_text(), path.name


def test_chat_template_renders_tool_schemas_and_responses() -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from pacerl.envs.chat_template import CHATML_TOOLS_TEMPLATE

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
        chat_template=CHATML_TOOLS_TEMPLATE,
    )
    env = CodeMathEnv(tasks=[TASK])
    observation, _ = env.reset()
    action = "two calls\n" + python_call("print(1)") + python_call("print(2)")
    responses, *_ = env.step(action)
    conversation = [*observation, {"role": "assistant", "content": action}, *responses]
    rendered = tokenizer.apply_chat_template(
        conversation, tools=env.tool_schemas(), tokenize=False, add_generation_prompt=True
    )
    env.close()
    schema = json.dumps(env.tool_schemas()[0])
    assert rendered.startswith("<|im_start|>system\nYou solve math problems.")
    assert f"<tools>\n{schema}\n</tools>" in rendered
    assert rendered.endswith(
        f"<|im_start|>assistant\n{action}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_code_the_sandbox_refuses_is_an_ordinary_tool_error(caplog: pytest.LogCaptureFixture) -> None:
    env = gymnasium.make("pacerl/CodeMath-v0")
    env.reset(options={"task": TASK})
    with caplog.at_level("WARNING"):
        observation, _, terminated, truncated, info = env.step(python_call("print(1)\x00"))
    message = "the sandbox refused this call: code contains a NUL byte"
    assert observation == ({"role": "tool", "name": "python", "content": f"Error: {message}"},)
    assert info["step_errors"] == [message] and not terminated and not truncated
    assert not caplog.records  # the model's mistake, not a platform failure: nothing logged
    observation, *_ = env.step(python_call("print('next')"))
    assert observation[0]["content"] == "next"
    env.close()


async def test_the_python_tool_turns_a_sandbox_refusal_into_a_tool_error() -> None:
    # Code over the sandbox's cap cannot come through the env's parser (it caps a call first), but a
    # tool called by other means must answer the same way.
    context = ToolContext()
    try:
        with pytest.raises(ToolError, match=r"^the sandbox refused this call: code is larger than"):
            await get_tool("python")({"code": "#" * (1024 * 1024 + 1)}, context)
    finally:
        await context.aclose()


def test_an_episode_cannot_take_over_later_episodes_of_the_env() -> None:
    # Later CodeMath episodes reuse the first one's sandbox (recycled sessions): whatever the first
    # episode's code tries, the later episodes' calls are answered by their own code.
    env = gymnasium.make("pacerl/CodeMath-v0")
    env.reset(options={"task": TASK})
    observation, *_ = env.step(python_call(TAKEOVER))
    report = json.loads(observation[0]["content"])
    assert report and all(value in (-1, [], "denied") for value in report.values()), report
    for number in range(6):
        env.reset(options={"task": TASK})
        observation, *_ = env.step(python_call(f"print('canary' in globals(), {number} * 7)"))
        assert observation[0]["content"] == f"False {number * 7}", observation
    env.close()
