"""What an evaluation reports: each episode's outcome (`EpisodeOutcome`, whoever played it), each task's
count of correct episodes, and the `EvalReport` built from them (avg@K, pass@k, reward, tool use, turns,
tokens and how episodes ended), as a table for the terminal and as JSON; and an episode's transcript.

An episode is correct when its final reward reaches `success_threshold`; however many turns or tool calls
it took, it counts once."""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from pacerl.agents.evaluation.config import EvalConfig
from pacerl.agents.evaluation.scores import avg_at_k, majority_correct, pass_at_k
from pacerl.agents.trajectory import Origin, Status, Trajectory
from pacerl.envs import Task


@dataclass(frozen=True)
class TaskResult:
    """One task's outcome."""

    task_id: str
    """The task."""
    samples: int
    """Episodes played on it."""
    correct: int
    """Of those, the episodes whose reward reached the threshold."""
    majority_correct: bool | None = None
    """Whether the answer most of its episodes gave is a correct one (`majority_correct`); None when
    the env extracts no answers."""


@dataclass(frozen=True)
class EvalReport:
    """What `evaluate` measured. Rates and means are over all episodes, failed ones included."""

    label: str
    """What was evaluated, in the caller's words (e.g. the model and the env)."""
    policy_version: int
    """The engine's policy version (`engine.version`) when the evaluation ended."""
    tasks: int
    """Tasks evaluated."""
    episodes: int
    """Episodes played: tasks × samples."""
    samples: int
    """K: episodes per task."""
    avg_at_k: float
    """avg@K: the mean over tasks of the share of their K episodes that are correct."""
    pass_at_k: Mapping[int, float]
    """k -> the mean over tasks of the unbiased pass@k, for each k of the config's `all_ks`."""
    mean_reward: float
    """Mean final reward per episode (a failed episode, which has none, counts 0)."""
    tool_call_rate: float
    """Share of episodes that made at least one tool call."""
    mean_turns: float
    """Mean assistant turns per episode."""
    mean_generated_tokens: float
    """Mean tokens the model generated per episode (all its turns together)."""
    failures: Mapping[str, int]
    """`"<status>: <reason>"` -> episodes that ended so (truncated or failed), e.g. `truncated: max_turns`."""
    per_task: tuple[TaskResult, ...]
    """Each task's correct count, in the order evaluated."""
    wall_seconds: float
    """Wall-clock time of the whole evaluation."""
    config: EvalConfig
    """The config it ran with."""
    maj_at_k: float | None = None
    """maj@K: the share of tasks whose K episodes' most frequent final answer is correct
    (`scores.majority_correct`: ties go to the answer given first); None when the env extracts no
    answers (it has no `final_answer`)."""

    @property
    def failed_episodes(self) -> int:
        """Episodes that ended `failed` (an engine or env error), not scored by the model's answer."""
        return sum(count for ending, count in self.failures.items() if ending.startswith("failed"))

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types (pass@k keyed by k as a string)."""
        data = asdict(self)
        data["pass_at_k"] = {str(k): value for k, value in self.pass_at_k.items()}
        data["failures"] = dict(self.failures)
        data["config"]["ks"] = list(self.config.ks)
        data["config"]["stop_strings"] = list(self.config.stop_strings)
        data["per_task"] = [
            {k: v for k, v in asdict(result).items() if v is not None or k != "majority_correct"}
            for result in self.per_task
        ]  # an env that extracts no answers leaves maj@k out of each task's entry
        return data

    def table(self) -> str:
        """The headline numbers as an aligned text table for the terminal."""
        table = Table(title=self.label or None, show_header=False)
        table.add_column("metric")
        table.add_column("value", justify="right")
        rows = [
            ("tasks", str(self.tasks)),
            ("episodes", f"{self.episodes} ({self.samples} per task)"),
            (f"avg@{self.samples}", f"{self.avg_at_k:.3f}"),
            *((f"pass@{k}", f"{value:.3f}") for k, value in self.pass_at_k.items()),
            *([(f"maj@{self.samples}", f"{self.maj_at_k:.3f}")] if self.maj_at_k is not None else []),
            ("mean reward", f"{self.mean_reward:.3f}"),
            ("tool-call rate", f"{self.tool_call_rate:.3f}"),
            ("mean turns", f"{self.mean_turns:.2f}"),
            ("mean generated tokens", f"{self.mean_generated_tokens:.1f}"),
            *((f"ended {reason}", str(count)) for reason, count in self.failures.items()),
            ("policy version", str(self.policy_version)),
            ("wall seconds", f"{self.wall_seconds:.1f}"),
        ]
        for row in rows:
            table.add_row(*row)
        buffer = io.StringIO()
        # No colours or terminal probing: the same text on a terminal, in a pipe and in a test.
        Console(file=buffer, width=100, color_system=None, force_terminal=False).print(table)
        return buffer.getvalue()


@dataclass(frozen=True)
class EpisodeOutcome:
    """What the report counts of one episode, whoever played it (the rollout driver, a served model)."""

    status: Status
    status_reason: str
    reward: float | None
    """The final reward; None for a failed episode."""
    called_a_tool: bool
    turns: int
    generated_tokens: int
    answer: str | None = None
    """The final answer the env extracted from the episode's last message (`final_answer`), if any."""


def build_report(
    tasks: Sequence[Task],
    groups: Sequence[Sequence[EpisodeOutcome]],
    config: EvalConfig,
    version: int,
    label: str,
    wall: float,
    *,
    vote: bool = False,
) -> EvalReport:
    """The `EvalReport` of each task's episodes (`groups`, in the order of `tasks`); with `vote` (the
    env extracts final answers), maj@K from the episodes' `answer`s."""
    episodes = [outcome for group in groups for outcome in group]
    if not episodes:
        raise ValueError("no episodes to report")
    threshold = config.success_threshold

    def result(task: Task, group: Sequence[EpisodeOutcome]) -> TaskResult:
        correct = [e.reward is not None and e.reward >= threshold for e in group]
        majority = majority_correct([e.answer for e in group], correct) if vote else None
        return TaskResult(task.id, len(group), sum(correct), majority)

    results = tuple(result(task, group) for task, group in zip(tasks, groups, strict=True))
    failures = Counter(
        f"{e.status.value}: {e.status_reason}" for e in episodes if e.status is not Status.COMPLETED
    )
    count = len(episodes)
    return EvalReport(
        label=label,
        policy_version=version,
        tasks=len(tasks),
        episodes=count,
        samples=config.samples,
        avg_at_k=_mean(avg_at_k(r.samples, r.correct) for r in results),
        pass_at_k={k: _mean(pass_at_k(r.samples, r.correct, k) for r in results) for k in config.all_ks},
        mean_reward=sum(e.reward or 0.0 for e in episodes) / count,
        tool_call_rate=sum(e.called_a_tool for e in episodes) / count,
        mean_turns=sum(e.turns for e in episodes) / count,
        mean_generated_tokens=sum(e.generated_tokens for e in episodes) / count,
        failures=dict(sorted(failures.items())),
        per_task=results,
        wall_seconds=wall,
        config=config,
        maj_at_k=_mean(float(bool(r.majority_correct)) for r in results) if vote else None,
    )


def trajectory_outcome(trajectory: Trajectory, answer: str | None = None) -> EpisodeOutcome:
    """What the report counts of an episode the rollout driver played (`answer`: its final answer)."""
    return EpisodeOutcome(
        trajectory.status,
        trajectory.status_reason,
        trajectory.reward,
        _called_a_tool(trajectory),
        trajectory.num_turns,
        trajectory.num_model_tokens,
        answer,
    )


def last_turn_text(trajectory: Trajectory, tokenizer: Any) -> str:
    """The text the model generated after the episode's last tool response: its final message."""
    turn: list[int] = []
    for segment in trajectory.segments[1:]:
        turn = [*turn, *segment.tokens] if segment.origin is Origin.MODEL else []
    return str(tokenizer.decode(turn, skip_special_tokens=True))


def final_answer(env: Any, final_message: str) -> str | None:
    """The env's reading of a final message's answer (its `final_answer`, e.g. the last `\\boxed{}`
    for Math, the last `<answer>` for Search-R1); None when it has none or the env extracts none."""
    extract = getattr(env, "final_answer", None)
    return extract(final_message) if callable(extract) else None


def _called_a_tool(trajectory: Trajectory) -> bool:
    """The env's own count when it reported one (its last info); else whether a tool response was
    appended, which an episode that failed or ran out of context before the env's last step still shows."""
    calls = trajectory.env_info.get("tool_calls")
    if isinstance(calls, int):
        return calls > 0
    return any(segment.origin is Origin.TOOL for segment in trajectory.segments)


def _mean(values: Iterable[float]) -> float:
    numbers = list(values)
    return sum(numbers) / len(numbers)


def transcript(trajectory: Trajectory, tokenizer: Any) -> dict[str, Any]:
    """One episode as a reader wants it: task, reward, how it ended, and each segment's text with its
    origin (prompt, model, tool) and, for the model's, the policy version that wrote it."""
    segments = []
    for segment in trajectory.segments:
        entry: dict[str, Any] = {
            "origin": segment.origin.value,
            "text": tokenizer.decode(list(segment.tokens)),
        }
        if segment.version is not None:
            entry["version"] = segment.version
        segments.append(entry)
    return {
        "id": trajectory.id,
        "task_id": trajectory.task_id,
        "reward": trajectory.reward,
        "status": trajectory.status.value,
        "status_reason": trajectory.status_reason,
        "segments": segments,
    }
