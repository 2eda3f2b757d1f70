"""Multi-turn evaluation: K sampled episodes per task through the rollout driver, scored per episode.

An episode is correct when its final reward reaches `success_threshold`; however many turns or tool calls
it took, it counts once. From the per-task counts of correct episodes come avg@K and the unbiased
pass@k of Chen et al. 2021, "Evaluating Large Language Models Trained on Code" (arXiv:2107.03374).

    report = await evaluate(engine, tokenizer, make_env, load_tasks("codemath-val"), EvalConfig(samples=4))
    print(report.table())
"""

from __future__ import annotations

import asyncio
import io
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from agents.engine.protocol import Engine, SamplingParams
from agents.rollout import RolloutConfig, RolloutDriver
from agents.trajectory import Origin, Status, Trajectory
from envs import Task, ToolEnv


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator of Chen et al. 2021 (arXiv:2107.03374, section 2.1): the chance
    that at least one of k samples drawn without replacement from n, of which c are correct, is correct.

    1 − C(n−c, k) / C(n, k), computed as 1 − ∏_{i=n−c+1}^{n} (1 − k/i): the binomials overflow floats
    for large n, the product does not. Example: n=4, c=2, k=2 gives 1 − 1/6 = 5/6.
    """
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def avg_at_k(n: int, c: int) -> float:
    """avg@k: the mean correctness of the n = k samples of one task, c of them correct (the expected
    pass@1, estimated from all k samples)."""
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"avg@k needs n >= 1 and 0 <= c <= n; got n={n}, c={c}")
    return c / n


@dataclass(frozen=True)
class EvalConfig:
    """How a model is evaluated; the defaults sample as `pacerl train` does by default."""

    samples: int = 4
    """K: episodes sampled per task."""
    temperature: float = 0.7
    """Sampling temperature of every turn; 0 is greedy, and then `samples` must be 1."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1] (evaluation may truncate the distribution; training may not)."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0 keeps all."""
    max_new_tokens: int = 40
    """Tokens generated per assistant turn at most."""
    max_total_tokens: int = 256
    """Context budget of a whole episode (prompt, generations and tool responses)."""
    ks: tuple[int, ...] = (1,)
    """The k of each pass@k reported, each in 1..samples; k = samples is always reported too (`all_ks`)."""
    success_threshold: float = 1.0
    """An episode whose reward reaches this is correct (a failed episode, without reward, never is)."""
    max_tasks: int | None = None
    """Evaluate only the first this many tasks; None: all of them."""
    tool_schemas_in_prompt: bool = False
    """Render the env's tool schemas into the system turn (off, as in training, for a model that learned
    its tools by SFT)."""
    seed: int = 0
    """Seed of the engine's samplers where the caller builds the engine from this config (`pacerl eval`);
    an engine handed to `evaluate` keeps its own."""
    stop_strings: tuple[str, ...] = ("</tool_call>",)
    """Text that ends an assistant turn early, so the tool call it closes runs at once."""
    max_concurrent_tasks: int = 16
    """Tasks whose samples are played at once; the others wait. Every episode may hold a sandboxed
    interpreter, so this bounds the sandboxes alive as well as the engine's batch."""

    def __post_init__(self) -> None:
        problems = []
        if self.samples < 1:
            problems.append(f"samples must be >= 1, got {self.samples}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            problems.append(f"temperature must be finite and >= 0, got {self.temperature}")
        elif self.temperature == 0 and self.samples != 1:
            problems.append(
                f"temperature 0 is greedy: every sample would be the same; use samples=1, got {self.samples}"
            )
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            problems.append(f"top_p must be in (0, 1] and top_k >= 0, got {self.top_p} and {self.top_k}")
        if self.max_new_tokens < 1 or self.max_total_tokens < 2:
            problems.append("max_new_tokens must be >= 1 and max_total_tokens >= 2")
        if any(not 1 <= k <= self.samples for k in self.ks):
            problems.append(f"every k of ks must be in 1..samples ({self.samples}), got {self.ks}")
        if not math.isfinite(self.success_threshold):
            problems.append(f"success_threshold must be finite, got {self.success_threshold}")
        if self.max_tasks is not None and self.max_tasks < 1:
            problems.append(f"max_tasks must be >= 1 or None, got {self.max_tasks}")
        if self.max_concurrent_tasks < 1:
            problems.append(f"max_concurrent_tasks must be >= 1, got {self.max_concurrent_tasks}")
        if problems:
            raise ValueError("invalid eval config: " + "; ".join(problems))

    @property
    def all_ks(self) -> tuple[int, ...]:
        """The k of every pass@k reported: `ks` and `samples`, ascending. (`ks` itself stays as given, so
        that `dataclasses.replace(config, samples=...)` and a saved config read back behave alike.)"""
        return tuple(sorted({*self.ks, self.samples}))

    def rollout_config(self) -> RolloutConfig:
        """The driver's config: K samples per task as one group, failed episodes kept (they count as
        incorrect; dropping their group would flatter the model), no routes (nothing trains on them)."""
        sampling = SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_strings=self.stop_strings,
        )
        return RolloutConfig(
            group_size=self.samples,
            sampling=sampling,
            max_total_tokens=self.max_total_tokens,
            on_failure="keep",
            record_routes=False,
            tool_schemas_in_prompt=self.tool_schemas_in_prompt,
        )


@dataclass(frozen=True)
class TaskResult:
    """One task's outcome."""

    task_id: str
    """The task."""
    samples: int
    """Episodes played on it."""
    correct: int
    """Of those, the episodes whose reward reached the threshold."""


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
        data["per_task"] = [asdict(result) for result in self.per_task]
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


async def evaluate(
    engine: Engine,
    tokenizer: Any,
    make_env: Callable[[], ToolEnv],
    tasks: Sequence[Task],
    config: EvalConfig | None = None,
    *,
    num_experts: int = 0,
    label: str = "",
    on_group: Callable[[Sequence[Trajectory]], None] | None = None,
    on_episode: Callable[[int], None] | None = None,
) -> EvalReport:
    """Play `config.samples` episodes of each task (the first `max_tasks`) with `engine` through the
    rollout driver and score them per episode. `on_group` sees each task's finished episodes (to keep
    transcripts), `on_episode` the tokens each episode generated as it ends (progress). The engine is
    left open."""
    config = config or EvalConfig()
    chosen = list(tasks[: config.max_tasks] if config.max_tasks is not None else tasks)
    if not chosen:
        raise ValueError("there are no tasks to evaluate")
    if len({task.id for task in chosen}) != len(chosen):
        raise ValueError("task ids must be unique: each task's samples are one group named by its id")
    driver = RolloutDriver(engine, tokenizer, make_env, config.rollout_config(), num_experts=num_experts)
    if on_episode is not None:
        report_episode = on_episode
        driver.on_episode = lambda trajectory: report_episode(trajectory.num_model_tokens)
    slots = asyncio.Semaphore(config.max_concurrent_tasks)

    async def play(task: Task) -> list[Trajectory]:
        async with slots:
            group = await driver.rollout_group(task, group_id=f"eval/{task.id}")
        if on_group is not None:
            on_group(group)
        return group

    started = time.perf_counter()
    groups = await asyncio.gather(*(play(task) for task in chosen))
    wall = time.perf_counter() - started
    outcomes = [[_outcome(t) for t in group] for group in groups]
    return build_report(chosen, outcomes, config, engine.version, label, wall)


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


def build_report(
    tasks: Sequence[Task],
    groups: Sequence[Sequence[EpisodeOutcome]],
    config: EvalConfig,
    version: int,
    label: str,
    wall: float,
) -> EvalReport:
    """The `EvalReport` of each task's episodes (`groups`, in the order of `tasks`)."""
    episodes = [outcome for group in groups for outcome in group]
    if not episodes:
        raise ValueError("no episodes to report")
    threshold = config.success_threshold
    results = tuple(
        TaskResult(task.id, len(group), sum(e.reward is not None and e.reward >= threshold for e in group))
        for task, group in zip(tasks, groups, strict=True)
    )
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
    )


def _outcome(trajectory: Trajectory) -> EpisodeOutcome:
    return EpisodeOutcome(
        trajectory.status,
        trajectory.status_reason,
        trajectory.reward,
        _called_a_tool(trajectory),
        trajectory.num_turns,
        trajectory.num_model_tokens,
    )


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
