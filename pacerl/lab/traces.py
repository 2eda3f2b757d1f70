"""Workloads from measured trajectory records (`pacerl simulate --trace`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pacerl.agents.trajectory import Origin, Status, Trajectory
from pacerl.lab.costs import Distribution, WorkloadConfig


def workload_from_trace(trajectories: Sequence[Trajectory], group_size: int | None = None) -> WorkloadConfig:
    """A workload resampled from measured trajectory records (`pacerl.agents.trajectory_io.load_jsonl`):
    empirical prompt lengths, turns, tokens per turn (a turn is a run of model segments, interruptions
    merged), tool-response tokens, and tool latency (from a turn's last model segment ending to the next
    turn's first one starting: the tool plus the env step). `group_size` defaults to the most common group
    size in the trace."""
    finished = [t for t in trajectories if t.status is not Status.RUNNING]
    if not finished:
        raise ValueError("the trace holds no finished trajectory")
    prompts: list[float] = []
    turns: list[float] = []
    responses: list[float] = []
    tools: list[float] = []
    latencies: list[float] = []
    for trajectory in finished:
        prompts.append(trajectory.prompt_length)
        turn_tokens, in_turn, last_end, pending_tool = 0, False, None, 0
        count = 0
        for segment in trajectory.segments[1:]:
            if segment.origin is Origin.MODEL:
                if not in_turn:
                    if last_end is not None and segment.started_at is not None:
                        latencies.append(max(0.0, segment.started_at - last_end))
                    if pending_tool:
                        tools.append(pending_tool)
                    pending_tool, in_turn, count = 0, True, count + 1
                turn_tokens += len(segment.tokens)
                last_end = segment.ended_at
            else:
                if in_turn:
                    responses.append(turn_tokens)
                    turn_tokens, in_turn = 0, False
                pending_tool += len(segment.tokens)
        if in_turn:
            responses.append(turn_tokens)
        if count:
            turns.append(count)
    if not responses:
        raise ValueError("the trace holds no model tokens")
    sizes = Counter(t.group_id for t in finished)
    size = group_size or Counter(sizes.values()).most_common(1)[0][0]

    def empirical(values: list[float], default: float) -> Distribution:
        return Distribution.empirical(values) if values else Distribution.constant(default)

    return WorkloadConfig(
        group_size=size,
        prompt_tokens=empirical(prompts, 1),
        turns=empirical(turns, 1),
        response_tokens=empirical(responses, 1),
        tool_tokens=empirical(tools, 1),
        tool_latency_s=empirical(latencies, 0.0),
    )
