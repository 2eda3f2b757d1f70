"""The trajectory record and R3 routed experts, against hand-worked numbers."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pacerl.agents.routing import RoutedExperts, index_dtype
from pacerl.agents.trajectory import Origin, Segment, Status, Trajectory
from pacerl.agents.trajectory_io import load_jsonl, save_jsonl

E, L, K = 8, 2, 2  # experts, MoE layers, top_k of the routes used below


def routes(rows: int, seed: int) -> RoutedExperts:
    rng = np.random.default_rng(seed)
    return RoutedExperts.from_array(rng.integers(0, E, size=(rows, L, K)), E)


def worked_example(*, finish: bool = True) -> Trajectory:
    """prompt (3) | model v5 (2) | tool (2) | model v6 (1, interrupted) | model v7 (2, resumed)."""
    t = Trajectory.start("traj-0", "group-0", "task-0", [11, 12, 13])
    t.append_model(
        [21, 22],
        [-0.5, -0.25],
        version=5,
        started_at=100.0,
        ended_at=101.5,
        finish_reason="tool_call",
        routed_experts=routes(2, 0),
    )
    t.append_tool(np.array([31, 32]))
    t.append_model(
        [41],
        [-1.0],
        version=6,
        started_at=102.0,
        ended_at=102.5,
        finish_reason="abort",
        routed_experts=routes(1, 1),
    )
    t.append_model(
        np.array([42, 43]),
        np.array([-0.1, -1e-30], dtype=np.float64),
        version=7,
        started_at=103.0,
        ended_at=104.0,
        finish_reason="stop",
        routed_experts=routes(2, 2),
    )
    if finish:
        t.finish(
            Status.COMPLETED,
            reason="answered",
            reward=1.0,
            completed_version=7,
            completed_at=105.0,
            env_info={"turns": 2, "tool_calls": ["python"], "score": {"f1": 0.5}},
        )
    return t


def test_worked_example_derived_arrays() -> None:
    t = worked_example()
    np.testing.assert_array_equal(t.tokens, [11, 12, 13, 21, 22, 31, 32, 41, 42, 43])
    assert (t.prompt_length, t.response_length, t.num_model_tokens) == (3, 7, 5)
    np.testing.assert_array_equal(t.loss_mask, [0, 0, 0, 1, 1, 0, 0, 1, 1, 1])
    assert t.loss_mask.dtype == np.bool_
    np.testing.assert_array_equal(t.token_versions, [-1, -1, -1, 5, 5, -1, -1, 6, 7, 7])
    np.testing.assert_array_equal(t.behaviour_logprobs, [0, 0, 0, -0.5, -0.25, 0, 0, -1.0, -0.1, -1e-30])
    assert t.num_turns == 2  # v6 and v7 are one interrupted-and-resumed turn
    assert t.versions == (5, 6, 7)
    assert [s.origin for s in t.segments] == [
        Origin.PROMPT,
        Origin.MODEL,
        Origin.TOOL,
        Origin.MODEL,
        Origin.MODEL,
    ]


def test_worked_example_staleness() -> None:
    t = worked_example()
    # GS = mean(7-5, 7-5, 7-6, 7-7, 7-7) = 5/5; WS = 9 - 7
    assert t.generation_staleness() == 1.0
    assert t.waiting_staleness(9) == 2
    assert t.staleness(9) == 3.0
    np.testing.assert_array_equal(t.token_staleness(9), [4, 4, 3, 2, 2])
    assert float(np.mean(t.token_staleness(9))) == t.staleness(9)
    assert (t.generation_staleness(), t.waiting_staleness(7), t.staleness(7)) == (1.0, 0, 1.0)
    with pytest.raises(ValueError, match="behind"):
        t.waiting_staleness(6)
    running = worked_example(finish=False)
    for ask in (
        running.generation_staleness,
        lambda: running.waiting_staleness(9),
        lambda: running.staleness(9),
    ):
        with pytest.raises(RuntimeError, match="running"):
            ask()
    empty = Trajectory.start("t", "g", "task", [1])
    empty.finish(Status.FAILED, reason="engine died", reward=None, completed_version=3, completed_at=1.0)
    assert empty.waiting_staleness(4) == 1
    with pytest.raises(ValueError, match="no model tokens"):
        empty.generation_staleness()


def test_worked_example_routed_experts() -> None:
    t = worked_example()
    recorded = t.routed_experts()
    assert recorded is not None
    positions, rows = recorded
    np.testing.assert_array_equal(positions, [3, 4, 7, 8, 9])
    assert (rows.num_tokens, rows.num_layers, rows.top_k, rows.indices.dtype) == (5, L, K, np.dtype(np.uint8))
    assert rows == RoutedExperts.concat([routes(2, 0), routes(1, 1), routes(2, 2)])
    assert rows[2:3] == routes(1, 1)
    bare = Trajectory.start("t", "g", "task", [1, 2])
    bare.append_model([3], [-0.3], version=0, started_at=0.0, ended_at=0.0, finish_reason="stop")
    assert bare.routed_experts() is None


def test_routes_of_prompt_and_tool_tokens_are_attached_from_the_next_prefill() -> None:
    """The worked example recorded as an engine call sequence would: call 1's prefill routes the prompt
    (tokens 1-2; token 0 has no producing forward), call 2 (the resume) has nothing new before its
    token, call 3's prefill routes the tool response (tokens 5-6)."""
    t = Trajectory.start("traj-0", "group-0", "task-0", [11, 12, 13])
    assert t.routed_length == 0
    assert t.attach_routes(routes(2, 10), 0) == 1  # rows of input positions 0, 1 -> tokens 1, 2
    assert t.segments[0].routed_experts == routes(2, 10) and t.routed_length == 2
    model = {"started_at": 1.0, "ended_at": 2.0}
    t.append_model(
        [21, 22], [-0.5, -0.25], version=5, finish_reason="tool_call", routed_experts=routes(2, 0), **model
    )
    t.append_tool([31, 32])
    assert t.routed_length == 4  # tokens 1..4 routed; the tool's rows come with the next call
    with pytest.raises(ValueError, match=r"cover only part of the tool segment of tokens \[5, 7\)"):
        t.attach_routes(routes(1, 11), 4)
    with pytest.raises(ValueError, match="run past"):
        t.attach_routes(routes(3, 11), 4)
    assert t.attach_routes(routes(2, 11), 4) == 1 and t.routed_length == 6
    assert t.segments[2].routed_experts == routes(2, 11)
    t.append_model([41], [-1.0], version=6, finish_reason="abort", routed_experts=routes(1, 1), **model)
    assert t.attach_routes(routes(0, 12), 7) == 0  # a resume: no new positions before its tokens
    t.append_model(
        [42, 43], [-0.1, -0.2], version=7, finish_reason="stop", routed_experts=routes(2, 2), **model
    )
    assert t.routed_length == 9
    recorded = t.routed_experts()
    assert recorded is not None
    positions, rows = recorded
    np.testing.assert_array_equal(positions, np.arange(1, 10))  # every token but the first
    assert rows == RoutedExperts.concat(
        [routes(2, 10), routes(2, 0), routes(2, 11), routes(1, 1), routes(2, 2)]
    )
    assert t.attach_routes(routes(9, 13), 0) == 0  # routed segments keep the rows they have
    assert t.routed_experts()[1] == rows  # type: ignore[index]
    t.finish(Status.COMPLETED, reason="", reward=1.0, completed_version=7, completed_at=5.0)
    with pytest.raises(RuntimeError, match="already completed"):
        t.attach_routes(routes(1, 0), 0)
    assert Trajectory.from_json(json.loads(json.dumps(t.to_json()))) == t


def test_a_one_token_prompt_has_no_rows_and_a_format_1_record_fills_its_gaps() -> None:
    one = Trajectory.start("t", "g", "task", [7])
    assert one.attach_routes(routes(0, 0), 0) == 1 and one.segments[0].routed_experts == routes(0, 0)
    assert one.routed_length == 0
    # A format-1 record (model rows only) resumed: the next call asks for every position and the
    # prompt and tool segments get theirs, while the model segments keep their recorded rows.
    old = worked_example(finish=False)
    assert old.routed_length == 0
    full = routes(9, 20)
    assert old.attach_routes(full, 0) == 2
    assert old.segments[0].routed_experts == full[0:2] and old.segments[2].routed_experts == full[4:6]
    assert old.segments[1].routed_experts == routes(2, 0)
    assert old.routed_length == 9


def test_format_1_records_still_load_and_unknown_formats_fail_clearly() -> None:
    t = worked_example()
    data = t.to_json()
    assert data["format"] == 2
    old = {k: v for k, v in data.items() if k != "format"}  # what pacerl wrote before format 2
    assert Trajectory.from_json(old) == t
    assert Trajectory.from_json({**old, "format": 1}) == t
    with pytest.raises(ValueError, match="format 3 is not one this pacerl reads"):
        Trajectory.from_json({**data, "format": 3})
    routed = Trajectory.start("t", "g", "task", [1, 2])
    routed.attach_routes(routes(1, 0), 0)
    with pytest.raises(ValueError, match="format-1 trajectory record has routes on model segments only"):
        Trajectory.from_json({**routed.to_json(), "format": 1})


def test_routed_experts_compaction_and_views() -> None:
    assert [index_dtype(n) for n in (1, 256, 257, 65_536, 65_537)] == [np.uint8, np.uint8] + [
        np.uint16
    ] * 2 + [np.uint32]
    source = np.array([[[0, 255]], [[7, 3]]], dtype=np.int64)
    r = RoutedExperts.from_array(source, 256, num_layers=1, top_k=2)
    assert (r.indices.dtype, r.indices.shape, len(r)) == (np.dtype(np.uint8), (2, 1, 2), 2)
    source[0, 0, 0] = 9  # stored as a copy: the caller's array may change later
    assert r.indices[0, 0, 0] == 0
    with pytest.raises(ValueError, match="read-only"):
        r.indices[0, 0, 0] = 1
    assert RoutedExperts.from_array(torch.tensor([[[1, 2]]]), 300).indices.dtype == np.uint16
    assert RoutedExperts.from_array([[[1, 2]]], 300) == RoutedExperts.from_array(np.array([[[1, 2]]]), 300)
    assert r != RoutedExperts.from_array(source, 256)
    assert r != RoutedExperts.from_array(np.array([[[0, 255]], [[7, 3]]]), 257)  # same indices, other E
    assert r[1:] == RoutedExperts.from_array([[[7, 3]]], 256) and len(r[5:]) == 0
    assert RoutedExperts.concat([r[:1], r[1:]]) == r
    assert repr(r) == "RoutedExperts(tokens=2, layers=1, top_k=2, num_experts=256, dtype=uint8)"
    wide = RoutedExperts.from_array([[[70_000, 1]]], 70_001)
    for x in (r, wide, r[:0]):
        assert RoutedExperts.from_json(json.loads(json.dumps(x.to_json()))) == x


def test_from_sglang_decodes_little_endian_int32() -> None:
    prompt, completion = 3, 2
    stream = np.arange((prompt + completion - 1) * L * K, dtype=np.int32).reshape(-1, L, K) % E
    b64 = base64.b64encode(stream.astype("<i4").tobytes()).decode()
    r = RoutedExperts.from_sglang(b64, num_layers=L, top_k=K, num_experts=E)
    assert (r.num_tokens, r.num_layers, r.top_k) == (4, L, K)
    np.testing.assert_array_equal(r.indices, stream)
    # The completion's own rows (one per generated token) are the last `completion` rows.
    np.testing.assert_array_equal(r[-completion:].indices, stream[2:])
    with pytest.raises(ValueError, match="not a multiple"):
        RoutedExperts.from_sglang(b64, num_layers=3, top_k=K, num_experts=E)
    with pytest.raises(ValueError, match="base64"):
        RoutedExperts.from_sglang("not base64!", num_layers=L, top_k=K, num_experts=E)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        RoutedExperts.from_sglang(b64, num_layers=L, top_k=K, num_experts=4)
    with pytest.raises(ValueError, match=">= 1"):
        RoutedExperts.from_sglang(b64, num_layers=0, top_k=K, num_experts=E)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: RoutedExperts(np.zeros((2, 2), dtype=np.int32), E), "shape"),
        (lambda: RoutedExperts(np.full((1, 1, 2), -1), E), r"\[0, 8\)"),
        (lambda: RoutedExperts(np.full((1, 1, 2), 8), E), r"\[0, 8\)"),
        (lambda: RoutedExperts(np.zeros((1, 1, 2), dtype=np.float32), E), "integers"),
        (lambda: RoutedExperts(np.zeros((1, 1, 2), dtype=bool), E), "integers"),
        (lambda: RoutedExperts(np.zeros((1, 0, 2), dtype=np.int32), E), ">= 1"),
        (lambda: RoutedExperts([[[0, 1]]], E), "numpy array"),  # type: ignore[arg-type]
        (lambda: RoutedExperts(np.zeros((1, 1, 2), dtype=np.int32), 0), "num_experts"),
        (lambda: RoutedExperts.from_array(np.zeros((1, 2, 2), dtype=np.int32), E, num_layers=3), "3 layers"),
        (lambda: RoutedExperts.from_array(np.zeros((1, 2, 2), dtype=np.int32), E, top_k=1), "top_k=1"),
        (lambda: RoutedExperts.concat([routes(1, 0), RoutedExperts.from_array([[[0]]], E)]), "cannot concat"),
        (lambda: RoutedExperts.concat([]), "at least one"),
        (
            lambda: RoutedExperts.from_json(
                {"num_experts": E, "dtype": "int8", "shape": [0, 1, 1], "data": ""}
            ),
            "dtype",
        ),
        (lambda: RoutedExperts.from_json({**routes(2, 0).to_json(), "shape": [3, L, K]}), "does not match"),
    ],
)
def test_routed_experts_validation(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


MODEL: dict[str, Any] = {"version": 1, "started_at": 1.0, "ended_at": 2.0, "finish_reason": "stop"}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"origin": Origin.MODEL, "tokens": (1, 2), "logprobs": (-0.1,), **MODEL}, "1 logprobs for 2 tokens"),
        ({"origin": Origin.MODEL, "tokens": (1,), "logprobs": (float("nan"),), **MODEL}, "finite"),
        ({"origin": Origin.MODEL, "tokens": (1,), "logprobs": (-0.1,)}, "needs version, started_at"),
        ({"origin": Origin.MODEL, "tokens": (1,), "logprobs": (-0.1,), **MODEL, "version": -1}, "version"),
        ({"origin": Origin.MODEL, "tokens": (1,), "logprobs": (-0.1,), **MODEL, "version": 1.0}, "int"),
        ({"origin": Origin.MODEL, "tokens": (1,), "logprobs": (-0.1,), **MODEL, "ended_at": 0.5}, "ended_at"),
        (
            {"origin": Origin.MODEL, "tokens": (1,), "logprobs": (-0.1,), **MODEL, "finish_reason": ""},
            "finish",
        ),
        (
            {
                "origin": Origin.MODEL,
                "tokens": (1,),
                "logprobs": (-0.1,),
                **MODEL,
                "routed_experts": routes(2, 0),
            },
            "1 rows",
        ),
        (
            {"origin": Origin.PROMPT, "tokens": (1, 2), "routed_experts": routes(2, 0)},
            "prompt segment of 2 tokens",
        ),
        ({"origin": Origin.TOOL, "tokens": (1, 2), "routed_experts": routes(1, 0)}, "with 2 rows"),
        ({"origin": Origin.PROMPT, "tokens": (1,), "logprobs": (-0.1,)}, "prompt segment has no logprobs"),
        ({"origin": Origin.TOOL, "tokens": (1,), "version": 3}, "tool segment has no version"),
        ({"origin": Origin.TOOL, "tokens": ()}, "non-empty"),
        ({"origin": Origin.TOOL, "tokens": (1, -2)}, ">= 0"),
        ({"origin": Origin.TOOL, "tokens": (1.0, 2.0)}, "integers"),
        ({"origin": "tool", "tokens": (1,)}, "Origin"),
    ],
)
def test_segment_validation(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Segment(**fields)


def test_trajectory_validation() -> None:
    prompt, tool = Segment(Origin.PROMPT, (1,)), Segment(Origin.TOOL, (2,))
    for segments in ((), (tool,), (prompt, prompt)):
        with pytest.raises(ValueError, match="prompt"):
            Trajectory("t", "g", "task", segments)
    with pytest.raises(ValueError, match="id"):
        Trajectory("", "g", "task", (prompt,))
    with pytest.raises(ValueError, match="running trajectory has no reward"):
        Trajectory("t", "g", "task", (prompt,), reward=1.0)
    with pytest.raises(ValueError, match="completed trajectory needs a reward"):
        Trajectory("t", "g", "task", (prompt,), Status.COMPLETED, completed_version=0, completed_at=0.0)
    t = worked_example(finish=False)
    with pytest.raises(ValueError, match="completed_version must be >= 7"):
        t.finish(Status.COMPLETED, reason="ok", reward=1.0, completed_version=6, completed_at=1.0)
    with pytest.raises(ValueError, match="JSON-serializable"):
        t.finish(
            Status.COMPLETED,
            reason="ok",
            reward=1.0,
            completed_version=7,
            completed_at=1.0,
            env_info={"x": object()},
        )
    with pytest.raises(ValueError, match="reward"):
        t.finish(
            Status.TRUNCATED, reason="max_turns", reward=float("inf"), completed_version=7, completed_at=1.0
        )
    with pytest.raises(ValueError, match="final status"):
        t.finish(Status.RUNNING, reason="", reward=None, completed_version=7, completed_at=1.0)
    assert t == worked_example(finish=False)  # failed finishes changed nothing
    wide = RoutedExperts.from_array(np.zeros((1, L + 1, K), dtype=np.int32), E)
    with pytest.raises(ValueError, match="disagree"):
        t.append_model(
            [5], [-0.2], version=7, started_at=1.0, ended_at=2.0, finish_reason="stop", routed_experts=wide
        )
    assert len(t.segments) == 5


def test_sealed_after_finish() -> None:
    t = worked_example()
    assert (t.status, t.status_reason, t.reward, t.completed_version) == (
        Status.COMPLETED,
        "answered",
        1.0,
        7,
    )
    with pytest.raises(RuntimeError, match="already completed"):
        t.finish(Status.FAILED, reason="again", reward=None, completed_version=7, completed_at=106.0)
    with pytest.raises(RuntimeError, match="already completed"):
        t.append_tool([1])
    with pytest.raises(RuntimeError, match="already completed"):
        t.append_model([1], [-0.1], version=8, started_at=1.0, ended_at=2.0, finish_reason="stop")
    assert t == worked_example()


def test_json_round_trip_is_exact(tmp_path: Path) -> None:
    t = worked_example(finish=False)
    f32 = np.array([-0.1, -3.3e-7], dtype=np.float32)  # an engine's float32 log-probs
    t.append_model(
        [7, 8],
        f32,
        version=7,
        started_at=1_764_000_000.123456,
        ended_at=1_764_000_001.5,
        finish_reason="stop",
        routed_experts=routes(2, 3),
    )
    t.finish(
        Status.TRUNCATED,
        reason="max_turns",
        reward=0.0,
        completed_version=8,
        completed_at=1_764_000_002.25,
        env_info={"turns": 3, "nested": [1, {"a": None}], "tuple": (1, 2)},
    )
    assert t.env_info["tuple"] == [1, 2]  # stored as plain JSON so a round trip cannot change it
    data = t.to_json()
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    back = Trajectory.from_json(json.loads(json.dumps(data)))
    assert back == t
    assert back.behaviour_logprobs.tobytes() == t.behaviour_logprobs.tobytes()
    assert back.behaviour_logprobs[-2:].tobytes() == f32.astype(np.float64).tobytes()
    assert back.behaviour_logprobs[-3] == -1e-30
    path = tmp_path / "trajectories.jsonl"
    other = worked_example()
    other.id = "traj-1"
    assert save_jsonl(path, [t, other]) == 2
    assert load_jsonl(path) == [t, other]
    with pytest.raises(ValueError, match="duplicate"):
        save_jsonl(path, [t, t])
    path.write_text(json.dumps({**data, "extra": 1}) + "\n")
    with pytest.raises(ValueError, match=r"trajectories.jsonl:1: trajectory JSON needs exactly"):
        load_jsonl(path)
    with pytest.raises(ValueError, match="is not a valid Status"):
        Trajectory.from_json({**data, "status": "done"})
