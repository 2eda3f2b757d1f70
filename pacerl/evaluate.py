"""`pacerl eval`: a saved model on an env's tasks, K sampled episodes each, built the way training builds
them; prints avg@K, pass@k, tool use and failures, and writes them as JSON with `--out` (and every
episode's transcript with `--episodes`).

    pacerl eval --model runs/sft/model --env pacerl/CodeMath-v0 --n 4 --max-tasks 50 --out eval.json

The library (torch, transformers, the envs) is imported only when an evaluation runs: `pacerl` builds
this parser for every subcommand, and those imports take seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from agents.evaluation import EvalConfig, EvalReport
    from agents.trajectory import Trajectory
    from envs import ToolEnv


def main_eval(
    model: str,
    env_id: str,
    n: int | None = None,
    tasks: str | None = None,
    out: str | None = None,
    *,
    temperature: float | None = None,
    max_tasks: int | None = None,
    retriever_url: str | None = None,
    seed: int | None = None,
    episodes: str | None = None,
) -> int:
    """The body of `pacerl eval`: evaluate the model directory `model` on `env_id`'s `tasks` (default:
    its validation set) with `n` samples per task; print the table and write the JSON report to `out`
    and each episode's transcript to `episodes` (JSONL, see `transcript`).
    Options left None keep `EvalConfig`'s defaults. `env_id`: any registered `ToolEnv` id, or
    `module:Name-v0` for a user's env (`envs.registry.env_class`); without `tasks`, the env's shipped
    validation set. What the env's tools need is started for the evaluation (`ToolEnv.services`: the
    Search env's BM25 retriever, in process, unless `retriever_url` names one).
    Bad input (no such directory, unknown env or task set, invalid option) raises a one-line
    ValueError (ConfigError) or OSError before any episode starts."""
    from agents.evaluation import EvalConfig
    from envs.registry import env_class
    from pacerl.assembly import env_factory, seed_everything
    from pacerl.config import ConfigError, config_from_dict
    from pacerl.train import quiet_logging

    quiet_logging()

    given: dict[str, Any] = {"samples": n, "temperature": temperature, "max_tasks": max_tasks, "seed": seed}
    config = replace(EvalConfig(), **{key: value for key, value in given.items() if value is not None})
    try:
        cls = env_class(env_id)
    except ValueError as error:
        raise ConfigError(f"--env: {error}") from None
    source = tasks if tasks is not None else cls.validation_tasks
    if source is None:
        raise ConfigError(f"--tasks: {env_id} ships no validation set; name a task file")
    env = {"id": env_id, "tasks": source, "retriever_url": retriever_url}
    run_config = config_from_dict({"seed": config.seed, "model": {"path": model}, "env": env})
    make_env = env_factory(run_config)  # a bad env or task set fails here, before the model loads
    policy, tokenizer = _load(model)
    seed_everything(run_config)
    label = f"{model} on {env_id} ({source or 'default tasks'})"
    with contextlib.ExitStack() as stack:
        started = stack.enter_context(cls.services({"retriever_url": retriever_url} if retriever_url else {}))
        if started:
            make_env = with_settings(make_env, started)
        transcripts = stack.enter_context(_open_for_writing(episodes)) if episodes is not None else None

        def keep(group: Sequence[Trajectory]) -> None:
            if transcripts is not None:
                for trajectory in group:
                    transcripts.write(json.dumps(transcript(trajectory, tokenizer)) + "\n")

        report = _run_eval(policy, tokenizer, make_env, config, label, keep)
    print(report.table(), end="")
    if episodes is not None:
        print(f"wrote {report.episodes} episodes to {episodes}")
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    return 0


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


@contextlib.contextmanager
def _open_for_writing(path: str) -> Iterator[TextIO]:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w", encoding="utf-8") as handle:
        yield handle


def _run_eval(
    policy: Any,
    tokenizer: Any,
    make_env: Callable[[], ToolEnv],
    config: EvalConfig,
    label: str,
    on_group: Callable[[Sequence[Trajectory]], None] | None = None,
) -> EvalReport:
    """Serve `policy` from an embedded engine and evaluate it on the tasks `make_env`'s envs hold."""
    import asyncio

    from agents.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from agents.evaluation import evaluate

    async def run() -> EvalReport:
        engine = EmbeddedEngine(policy, tokenizer, EmbeddedEngineConfig(seed=config.seed))
        probe = make_env()  # the tasks exactly as the env loaded them (as `pacerl train` takes them)
        tasks = probe.tasks
        probe.close()
        try:
            # Routes are not recorded in eval, so the model's expert count is not needed.
            return await evaluate(engine, tokenizer, make_env, tasks, config, label=label, on_group=on_group)
        finally:
            await engine.aclose()

    return asyncio.run(run())


def _load(model: str) -> tuple[Any, Any]:
    from agents.models import load_model
    from agents.tokenizer import with_chat_template
    from pacerl.config import ConfigError

    # Checked here: load_model would take a missing `a/b` path for a hub name and try the network.
    if not Path(model).expanduser().exists():
        raise ConfigError(f"--model: no model directory at {model}")
    try:
        policy, tokenizer = load_model(model)
    except (FileNotFoundError, ValueError, OSError) as error:
        raise ConfigError(f"--model: {error}") from None
    return policy, with_chat_template(tokenizer)  # the checkpoint's own template, pacerl's if none


def with_settings(make_env: Callable[[], ToolEnv], settings: Mapping[str, Any]) -> Callable[[], ToolEnv]:
    """`make_env` whose envs' tools also get `settings` (e.g. the address of a service that
    `ToolEnv.services` started); a ToolEnv reads its settings at every reset."""

    def make() -> ToolEnv:
        env = make_env()
        env.config = replace(env.config, settings={**env.config.settings, **settings})
        return env

    return make


def cmd_eval(args: argparse.Namespace) -> int:
    """`pacerl eval --model DIR --env ID [--n K] [--tasks FILE] [--out FILE] ...`."""
    return main_eval(
        args.model,
        args.env,
        args.n,
        args.tasks,
        args.out,
        temperature=args.temperature,
        max_tasks=args.max_tasks,
        retriever_url=args.retriever_url,
        seed=args.seed,
        episodes=args.episodes,
    )


def add_eval_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add the `eval` subcommand (handler `cmd_eval`) to `pacerl`'s subparsers; returns its parser."""
    parser = commands.add_parser(
        "eval", help="evaluate a model on an env's tasks: avg@K, pass@k, tool use, failures"
    )
    parser.add_argument("--model", required=True, metavar="DIR", help="a model directory (save_model layout)")
    parser.add_argument(
        "--env",
        required=True,
        metavar="ID",
        help="a registered env id (pacerl/CodeMath-v0, pacerl/Math-v0, pacerl/Search-v0) or module:Name-v0 "
        "for an env your module registers",
    )
    parser.add_argument("--n", type=int, metavar="K", help="episodes sampled per task (default 4)")
    parser.add_argument(
        "--tasks",
        metavar="FILE",
        help="a .jsonl/.parquet task file or shipped set (default: the env's *-val)",
    )
    parser.add_argument("--out", metavar="FILE", help="write the report as JSON here (default: print only)")
    parser.add_argument(
        "--temperature", type=float, metavar="T", help="sampling temperature; 0 is greedy, with --n 1"
    )
    parser.add_argument("--max-tasks", type=int, metavar="M", help="evaluate only the first M tasks")
    parser.add_argument(
        "--retriever-url",
        metavar="URL",
        help="the search tool's retriever (default: the env starts its own; Search-v0 serves BM25 over "
        "the shipped corpus in process)",
    )
    parser.add_argument("--seed", type=int, help="seed of the engine's samplers (default 0)")
    parser.add_argument(
        "--episodes", metavar="FILE", help="write every episode's transcript here (JSONL: segments as text)"
    )
    parser.set_defaults(handler=cmd_eval)
    return parser
