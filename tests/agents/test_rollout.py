"""The rollout driver: token-exact records, version-tagged segments across weight updates, many
concurrent episodes, and failures that never kill the batch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest
import torch

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.engine.protocol import Generation, SamplingParams
from pacerl.agents.models import TinyMoEConfig, build_tiny_moe
from pacerl.agents.rollout import ENGINE_BACKOFF_CAP_S, RolloutConfig, RolloutDriver, retry_delay
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.agents.trajectory import Origin, Status, Trajectory
from pacerl.envs import Task, load_tasks
from pacerl.envs.code_math import CodeMathEnv
from tests.agents.helpers import ScriptedEngine

TASK = Task("t1", "What is 123 * 45?", ("5535",))
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(123 * 45)"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return tiny_tokenizer()


async def test_record_decodes_to_exactly_the_rendered_conversation(tokenizer: object) -> None:
    engine = ScriptedEngine(tokenizer, [CALL, "The product is \\boxed{5535}.<|im_end|>"], abort_first=True)
    driver = RolloutDriver(engine, tokenizer, lambda: CodeMathEnv(tasks=[TASK]), RolloutConfig(group_size=1))
    (trajectory,) = await driver.rollout_group(TASK)
    assert trajectory.status is Status.COMPLETED and trajectory.reward == 1.0
    env = CodeMathEnv(tasks=[TASK])
    observation, _ = env.reset(options={"task": TASK})
    tool_messages, *_ = env.step(CALL)
    env.close()
    conversation = [
        *observation,
        {"role": "assistant", "content": CALL},
        *tool_messages,
        {"role": "assistant", "content": "The product is \\boxed{5535}."},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tools=env.tool_schemas(), tokenize=False)  # type: ignore[attr-defined]
    decoded = tokenizer.decode(list(trajectory.tokens), skip_special_tokens=False)  # type: ignore[attr-defined]
    assert decoded + "\n" == rendered  # the template's newline after the final <|im_end|> is never generated
    # The model's tokens are exactly what the engine produced, never re-tokenized.
    model_tokens = [t for s in trajectory.segments if s.origin is Origin.MODEL for t in s.tokens]
    expected = [
        t for turn in (CALL, "The product is \\boxed{5535}.<|im_end|>") for t in tokenizer.encode(turn)
    ]  # type: ignore[attr-defined]
    assert model_tokens == expected
    assert trajectory.loss_mask.sum() == len(expected)
    # The interrupted first turn became two segments: version 0, then version 1 after the resume.
    origins = [(s.origin.value, s.version) for s in trajectory.segments]
    assert origins == [("prompt", None), ("model", 0), ("model", 1), ("tool", None), ("model", 1)]
    assert driver.counts["resumed"] == 1
    assert engine.calls[1] == list(
        trajectory.tokens[: len(engine.calls[1])]
    )  # resumed with the accumulated tokens


async def test_weight_update_during_rollouts_changes_version_tags_once() -> None:
    tokenizer = tiny_tokenizer()
    model = build_tiny_moe(TinyMoEConfig(), tokenizer)
    engine = EmbeddedEngine(model, tokenizer)
    sampling = SamplingParams(max_new_tokens=40, temperature=1.0, seed=None)
    config = RolloutConfig(group_size=4, sampling=sampling, max_total_tokens=700)
    driver = RolloutDriver(engine, tokenizer, lambda: CodeMathEnv(tasks=[TASK]), config, num_experts=8)
    group = asyncio.ensure_future(driver.rollout_group(TASK))
    for _ in range(100_000):
        if engine._rows and len(engine._rows[0].tokens) >= 5:
            break
        await asyncio.sleep(0)
    new_weights = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    await engine.update_weights(new_weights, version=1)
    trajectories = await group
    await engine.aclose()
    spanning = [t for t in trajectories if tuple(t.versions) == (0, 1)]
    assert spanning, [t.versions for t in trajectories]
    for trajectory in spanning:
        versions = trajectory.token_versions[trajectory.loss_mask]
        switch = int((versions == 1).argmax())
        assert (versions[:switch] == 0).all() and (versions[switch:] == 1).all()
        assert trajectory.generation_staleness() > 0
        # Routes cover every token but the first up to the last generated one: prompt, tool and model.
        positions, routes = trajectory.routed_experts()  # type: ignore[misc]
        last = int(np.flatnonzero(trajectory.loss_mask)[-1])
        np.testing.assert_array_equal(positions, np.arange(1, last + 1))
        assert routes.indices.shape == (last, model.config.num_hidden_layers, 2)


@pytest.mark.slow
async def test_64_concurrent_codemath_episodes_with_the_tiny_model() -> None:
    tokenizer = tiny_tokenizer()
    model = build_tiny_moe(TinyMoEConfig(), tokenizer)
    engine = EmbeddedEngine(model, tokenizer)
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, stop_strings=("</tool_call>",))
    config = RolloutConfig(group_size=8, sampling=sampling, max_total_tokens=512)
    driver = RolloutDriver(
        engine, tokenizer, lambda: CodeMathEnv(tasks="codemath-val"), config, num_experts=8
    )
    groups = await asyncio.gather(*(driver.rollout_group(task) for task in load_tasks("codemath-val")[:8]))
    await engine.aclose()
    trajectories = [t for group in groups for t in group]
    assert len(trajectories) == 64 and len({t.id for t in trajectories}) == 64
    assert sum(driver.counts[f"status:{s.value}"] for s in Status) == 64
    for trajectory in trajectories:
        assert trajectory.status in (Status.COMPLETED, Status.TRUNCATED)
        assert json.loads(json.dumps(trajectory.to_json())) == trajectory.to_json()


def route_of(position: int, token: int) -> list[list[int]]:
    """A made-up routing `[layers=2, top_k=2]` that names the input position and token it came from."""
    first = (3 * position + token) % 8
    return [[first, (first + 1) % 8], [(first + 2) % 8, (first + 5) % 8]]


class RoutingScriptedEngine(ScriptedEngine):
    """The scripted turns with the routes an MoE engine sends: `route_of` each input position from
    `routed_experts_start_len` up to the last one whose next token was computed."""

    def __init__(self, tokenizer: object, turns: Sequence[str], abort_first: bool = False) -> None:
        super().__init__(tokenizer, turns, abort_first)
        self.starts: list[int] = []

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, request_id: str | None = None,
        return_routed_experts: bool = False, routed_experts_start_len: int = 0, session: str | None = None,
    ) -> Generation:  # fmt: skip
        out = await super().generate(input_ids, sampling, return_routed_experts=return_routed_experts)
        self.starts.append(routed_experts_start_len)
        return _with_routes(out, [*input_ids, *out.tokens], routed_experts_start_len)


class WholeStreamScriptedEngine(ScriptedEngine):
    """An engine without `routed_experts_start_len` (the Ray router's signature): every row, each call."""

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, request_id: str | None = None,
        return_routed_experts: bool = False, session: str | None = None,
    ) -> Generation:  # fmt: skip
        out = await super().generate(input_ids, sampling, return_routed_experts=return_routed_experts)
        return _with_routes(out, [*input_ids, *out.tokens], 0)


def _with_routes(out: Generation, sequence: list[int], start: int) -> Generation:
    rows = [route_of(p, sequence[p]) for p in range(start, len(sequence) - 1)]
    routes = np.array(rows, dtype=np.int32).reshape(-1, 2, 2)
    return replace(out, routed_experts=routes, routed_experts_start=start)


@pytest.mark.parametrize("engine_class", [RoutingScriptedEngine, WholeStreamScriptedEngine])
async def test_routes_cover_the_whole_sequence_and_each_call_asks_for_new_positions_only(
    tokenizer: object, engine_class: type[ScriptedEngine]
) -> None:
    """Prompt, interrupted turn, its resume, tool response, last turn: every token but the first has
    the row of the forward that produced it (prompt and tool rows from the next call's prefill), and
    each call asks only for the rows of positions the record does not hold yet."""
    engine = engine_class(tokenizer, [CALL, "The product is \\boxed{5535}.<|im_end|>"], abort_first=True)
    driver = RolloutDriver(
        engine, tokenizer, lambda: CodeMathEnv(tasks=[TASK]), RolloutConfig(group_size=1), num_experts=8
    )
    (trajectory,) = await driver.rollout_group(TASK)
    assert trajectory.status is Status.COMPLETED
    origins = [s.origin.value for s in trajectory.segments]
    assert origins == ["prompt", "model", "model", "tool", "model"]
    assert all(s.routed_experts is not None for s in trajectory.segments)
    tokens = list(trajectory.tokens)
    positions, routes = trajectory.routed_experts()  # type: ignore[misc]
    np.testing.assert_array_equal(positions, np.arange(1, len(tokens)))
    expected = np.array([route_of(t - 1, tokens[t - 1]) for t in range(1, len(tokens))])
    np.testing.assert_array_equal(routes.indices, expected)
    if isinstance(engine, RoutingScriptedEngine):
        # Call k asks from the last input position call k - 1 computed (its prompt + its tokens - 1):
        # the resume for its new tokens only, the last turn for the tool response's and its own.
        _, resumed, after_tool = engine.calls
        turn_rest, tool = trajectory.segments[2].tokens, trajectory.segments[3].tokens
        assert after_tool == [*resumed, *turn_rest, *tool]
        assert engine.starts == [0, len(resumed) - 1, len(resumed) + len(turn_rest) - 1]


class FailingEngine(ScriptedEngine):
    async def generate(self, *args: object, **kwargs: object) -> Generation:
        raise RuntimeError("the server went away")


async def test_engine_failures_fail_the_trajectory_and_drop_the_group(tokenizer: object) -> None:
    driver = RolloutDriver(
        FailingEngine(tokenizer, []),
        tokenizer,
        lambda: CodeMathEnv(tasks=[TASK]),
        RolloutConfig(group_size=3, engine_retries=1),
    )
    assert await driver.rollout_group(TASK) == []
    assert driver.counts["dropped_groups"] == 1 and driver.counts["status:failed"] == 3
    keep = RolloutDriver(
        FailingEngine(tokenizer, []),
        tokenizer,
        lambda: CodeMathEnv(tasks=[TASK]),
        RolloutConfig(group_size=2, on_failure="keep"),
    )
    kept = await keep.rollout_group(TASK)
    assert [t.status for t in kept] == [Status.FAILED, Status.FAILED]
    assert kept[0].status_reason == "engine failed: the server went away"


def test_retry_delay_doubles_to_its_cap() -> None:
    assert [retry_delay(n, 0.5, cap_s=3.0) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert retry_delay(1, 0.0) == 0.0 and retry_delay(10_000, 0.25) == ENGINE_BACKOFF_CAP_S
    with pytest.raises(ValueError, match="failures"):
        retry_delay(0, 0.5)
    with pytest.raises(ValueError, match="engine_backoff_s"):
        RolloutConfig(engine_backoff_s=-1.0)


class FlakyEngine(ScriptedEngine):
    """Fails its first `failures` calls (a server restarting), then plays its turns."""

    def __init__(self, tokenizer: object, turns: Sequence[str], failures: int) -> None:
        super().__init__(tokenizer, turns)
        self.failures = failures

    async def generate(self, *args: object, **kwargs: object) -> Generation:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the server is restarting")
        return await super().generate(*args, **kwargs)  # type: ignore[arg-type]


async def test_transient_engine_errors_are_retried_after_a_backoff_and_counted(
    tokenizer: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def recorded_sleep(delay: float) -> None:
        waits.append(delay)
        await real_sleep(0)

    monkeypatch.setattr("pacerl.agents.rollout.asyncio.sleep", recorded_sleep)
    driver = RolloutDriver(
        FlakyEngine(tokenizer, ["The product is \\boxed{5535}.<|im_end|>"], failures=2),
        tokenizer,
        lambda: CodeMathEnv(tasks=[TASK]),
        RolloutConfig(group_size=1, engine_retries=2, engine_backoff_s=0.25),
    )
    (trajectory,) = await driver.rollout_group(TASK)
    assert trajectory.status is Status.COMPLETED and trajectory.reward == 1.0
    assert driver.counts["engine_errors"] == 2 and waits == [0.25, 0.5]  # backoff doubles per failure
    assert driver.last_failure == ""
    dead = RolloutDriver(
        FailingEngine(tokenizer, []),
        tokenizer,
        lambda: CodeMathEnv(tasks=[TASK]),
        RolloutConfig(group_size=1, engine_retries=3, engine_backoff_s=1.0),
    )
    waits.clear()
    assert await dead.rollout_group(TASK) == []
    # three retries after 1, 2 and 4 s, then the trajectory fails: no wait after the last attempt
    assert dead.counts["engine_errors"] == 4 and waits == [1.0, 2.0, 4.0]
    assert dead.last_failure == "engine failed: the server went away"


async def test_prompt_longer_than_the_context_is_truncated(tokenizer: object) -> None:
    model = build_tiny_moe(TinyMoEConfig(), tokenizer)  # type: ignore[arg-type]
    engine = EmbeddedEngine(model, tokenizer, config=None)
    driver = RolloutDriver(
        engine, tokenizer, lambda: CodeMathEnv(tasks=[TASK]), RolloutConfig(group_size=1, max_total_tokens=50)
    )
    (trajectory,) = await driver.rollout_group(TASK)
    await engine.aclose()
    assert trajectory.status is Status.TRUNCATED and trajectory.status_reason == "context budget exhausted"
    with pytest.raises(ValueError, match="group_size"):
        RolloutConfig(group_size=0)


class GatedEngine(ScriptedEngine):
    """A scripted engine whose second call waits until `release` is set (an episode caught mid-way)."""

    def __init__(self, tokenizer: object, turns: Sequence[str]) -> None:
        super().__init__(tokenizer, turns)
        self.release = asyncio.Event()

    async def generate(self, *args: object, **kwargs: object) -> Generation:
        if self.calls:
            await self.release.wait()
        return await super().generate(*args, **kwargs)  # type: ignore[arg-type]


async def test_in_flight_records_resume_to_the_same_episode(tokenizer: object) -> None:
    """A checkpoint's partial record (one turn and its tool output done, the second turn cut short by
    an interrupt) resumes in a fresh driver: the tool reruns, generation continues from the last token,
    and the finished record equals an uninterrupted episode token for token."""
    final = "The product is \\boxed{5535}.<|im_end|>"
    gated = GatedEngine(tokenizer, [CALL, final])
    driver = RolloutDriver(gated, tokenizer, lambda: CodeMathEnv(tasks=[TASK]), RolloutConfig(group_size=2))
    group = asyncio.ensure_future(driver.rollout_group(TASK, "g7"))
    for _ in range(1000):
        snapshot = driver.in_flight()
        if any(len(t.segments) == 3 for t in snapshot.get("g7", [])):
            break
        await asyncio.sleep(0.01)
    partial = next(t for t in snapshot["g7"] if len(t.segments) == 3)
    assert partial.status is Status.RUNNING and [s.origin for s in partial.segments] == [
        Origin.PROMPT,
        Origin.MODEL,
        Origin.TOOL,
    ]
    gated.turns = [CALL, final, final]  # let the group finish
    gated.release.set()
    reference = next(t for t in await group if t.id == partial.id)
    # Cut the second turn in two, as an interrupt would have left it, then resume the record.
    second = tokenizer.encode(final)  # type: ignore[attr-defined]
    saved = Trajectory.from_json(partial.to_json())
    saved.append_model(second[:4], [-0.5] * 4, version=3, started_at=0, ended_at=0, finish_reason="abort")
    engine = ScriptedEngine(tokenizer, [tokenizer.decode(second[4:])])  # type: ignore[attr-defined]
    resumed_driver = RolloutDriver(
        engine, tokenizer, lambda: CodeMathEnv(tasks=[TASK]), RolloutConfig(group_size=2)
    )
    other = (
        reference.id.replace("/0", "/1") if reference.id.endswith("/0") else reference.id.replace("/1", "/0")
    )
    done = Trajectory.from_json(reference.to_json())
    done_other = Trajectory.from_json(done.to_json() | {"id": other})
    saved_tokens = list(saved.tokens)
    result = await resumed_driver.rollout_group(TASK, "g7", resume={saved.id: saved, other: done_other})
    resumed = next(t for t in result if t.id == saved.id)
    assert resumed.status is Status.COMPLETED and resumed.reward == 1.0
    assert list(resumed.tokens) == list(reference.tokens)
    assert [s.version for s in resumed.segments[3:]] == [3, 0]  # the cut-short turn, then its rest
    assert engine.calls == [saved_tokens]  # generation continued from the last saved token
    assert resumed_driver.counts["resumed_from_checkpoint"] == 1
    assert resumed_driver.counts["resume_tool_output_changed"] == 0
    assert next(t for t in result if t.id == other) is done_other  # a finished member is kept as saved
    with pytest.raises(ValueError, match="not members"):
        await resumed_driver.rollout_group(TASK, "g8", resume={saved.id: saved})
