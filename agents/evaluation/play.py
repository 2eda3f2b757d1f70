"""Playing an evaluation: K episodes of each task, by a token engine through the rollout driver
(`evaluate`) or by a served chat-completions model message by message (`evaluate_served`), scored per
episode into one `EvalReport`. Both share the same task choice, per-task concurrency bound, callbacks
and report, so a local and a served model are measured alike.

    report = await evaluate(engine, tokenizer, make_env, load_tasks("codemath-val"), EvalConfig(samples=4))
    report = await evaluate_served(client, make_env, load_tasks("codemath-val"), EvalConfig(samples=4))
    print(report.table())
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from pacerl.agents.engine.openai_chat import OpenAIChatClient
from pacerl.agents.engine.protocol import Engine
from pacerl.agents.evaluation.config import EvalConfig
from pacerl.agents.evaluation.report import (
    EpisodeOutcome,
    EvalReport,
    build_report,
    final_answer,
    last_turn_text,
    trajectory_outcome,
)
from pacerl.agents.evaluation.served import ServedEpisode, play_episode, served_stop_strings
from pacerl.agents.rollout import RolloutDriver
from pacerl.agents.trajectory import Status, Trajectory
from pacerl.envs import Task, ToolEnv

Episode = TypeVar("Episode")


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
    chosen = chosen_tasks(tasks, config)
    driver = RolloutDriver(engine, tokenizer, make_env, config.rollout_config(), num_experts=num_experts)
    if on_episode is not None:
        report_episode = on_episode
        driver.on_episode = lambda trajectory: report_episode(trajectory.num_model_tokens)

    async def play(task: Task) -> list[Trajectory]:
        return await driver.rollout_group(task, group_id=f"eval/{task.id}")

    probe = make_env()
    vote = callable(getattr(probe, "final_answer", None))
    probe.close()
    groups, wall = await _play_groups(chosen, config, play, on_group)

    def outcome(trajectory: Trajectory) -> EpisodeOutcome:
        if not vote or trajectory.status is not Status.COMPLETED:
            return trajectory_outcome(trajectory)
        return trajectory_outcome(trajectory, final_answer(probe, last_turn_text(trajectory, tokenizer)))

    outcomes = [[outcome(t) for t in group] for group in groups]
    return build_report(chosen, outcomes, config, engine.version, label, wall, vote=vote)


async def evaluate_served(
    client: OpenAIChatClient,
    make_env: Callable[[], ToolEnv],
    tasks: Sequence[Task],
    config: EvalConfig | None = None,
    *,
    label: str = "",
    on_group: Callable[[Sequence[ServedEpisode]], None] | None = None,
    on_episode: Callable[[int], None] | None = None,
) -> EvalReport:
    """`evaluate` for a served model: `config.samples` episodes of each task (the first `max_tasks`),
    scored per episode into the same `EvalReport`; `on_episode` gets each episode's generated tokens as
    it ends. From `config` it takes samples, temperature, max_new_tokens (per answer), max_total_tokens
    (the conversation's tokens, from the server's usage counts), ks, success_threshold, max_tasks, seed
    (each request's seed derives from it) and max_concurrent_tasks; the stop strings are the env's
    (`served_stop_strings`) and the client's, the tools the client's (`OpenAIChatOptions`), and the
    report's config says so. `policy_version` is 0: a served
    model has no version pacerl knows. The client is left open."""
    config = config or EvalConfig()
    chosen = chosen_tasks(tasks, config)
    await client.model()  # a wrong URL or key fails here, once, not in every episode

    async def episode(task: Task, index: int) -> ServedEpisode:
        env = make_env()
        try:
            played = await play_episode(client, env, task, config, f"eval/{task.id}/{index}")
        finally:
            env.close()
        if on_episode is not None:
            on_episode(played.completion_tokens)
        return played

    async def play(task: Task) -> list[ServedEpisode]:
        return list(await asyncio.gather(*(episode(task, i) for i in range(config.samples))))

    probe = make_env()
    stops = served_stop_strings(client.options, probe)  # the env's and the client's
    vote = callable(getattr(probe, "final_answer", None))
    probe.close()
    groups, wall = await _play_groups(chosen, config, play, on_group)
    ran = replace(config, stop_strings=stops, tool_schemas_in_prompt=client.options.tools)
    return served_report(chosen, groups, ran, label, wall, vote=vote)


def served_report(
    tasks: Sequence[Task],
    groups: Sequence[Sequence[ServedEpisode]],
    config: EvalConfig,
    label: str,
    wall: float,
    *,
    vote: bool = False,
) -> EvalReport:
    """The `EvalReport` of served episodes, computed as `evaluate` computes it from trajectories
    (`vote`: report maj@K from the episodes' answers)."""
    outcomes: list[list[EpisodeOutcome]] = [[episode.outcome() for episode in group] for group in groups]
    return build_report(tasks, outcomes, config, 0, label, wall, vote=vote)


def chosen_tasks(tasks: Sequence[Task], config: EvalConfig) -> list[Task]:
    """The tasks evaluated (the first `max_tasks`); a ValueError for none or for repeated ids (each task's
    samples are one group named by its id)."""
    chosen = list(tasks[: config.max_tasks] if config.max_tasks is not None else tasks)
    if not chosen:
        raise ValueError("there are no tasks to evaluate")
    if len({task.id for task in chosen}) != len(chosen):
        raise ValueError("task ids must be unique: each task's samples are one group named by its id")
    return chosen


async def _play_groups(
    tasks: Sequence[Task],
    config: EvalConfig,
    play: Callable[[Task], Awaitable[list[Episode]]],
    on_group: Callable[[Sequence[Episode]], None] | None,
) -> tuple[list[list[Episode]], float]:
    """Every task's group of episodes, at most `max_concurrent_tasks` tasks at once (each episode may hold
    a sandbox), in the order of `tasks`; and the wall-clock seconds it took."""
    slots = asyncio.Semaphore(config.max_concurrent_tasks)

    async def group(task: Task) -> list[Episode]:
        async with slots:
            played = await play(task)
        if on_group is not None:
            on_group(played)
        return played

    started = time.perf_counter()
    groups = await asyncio.gather(*(group(task) for task in tasks))
    return list(groups), time.perf_counter() - started
