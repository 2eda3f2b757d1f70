"""`pacerl eval`: a model on an env's tasks, K sampled episodes each, built the way training builds them;
prints avg@K, pass@k, tool use and failures, and writes them as JSON with `--out` (the resolved config
beside them) and every episode's transcript with `--episodes`.

    pacerl eval --model runs/sft/model --env pacerl/CodeMath-v0 --n 4 --max-tasks 50 --out eval.json
    pacerl eval --config eval.toml env.system_prompt=null evaluation.settings.tool_schemas_in_prompt=true
    pacerl eval engine_backend=openai openai.base_url=http://127.0.0.1:8000/v1 --env pacerl/CodeMath-v0

The config is the run's (`pacerl.config.RunConfig`, the same file and `key=value` overrides as
`pacerl train`): `model.path`, the env (`env.id`, prompt, turns, tool budget), how episodes are sampled
(`evaluation.settings`: samples, temperature, top_p, top_k, token budgets, tool schemas in the prompt),
the held-out tasks (`evaluation.tasks`, default the env's validation set) and the engine
(`engine_backend`: embedded, sglang, or openai for any served chat-completions model). The flags are
shorthands for those keys; a `key=value` given after them wins. Unlike a training run's in-loop check
(greedy, one sample), `evaluation.settings` default here to K = 4 samples at T = 0.7.

The command's parser is in `pacerl.cli`, which imports this module only when `pacerl eval` runs (torch
and transformers take seconds to import, and `pacerl --help` builds every parser).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.engine.openai_chat import OpenAIChatClient
from pacerl.agents.engine.protocol import Engine
from pacerl.agents.engine.sglang import SGLangEngine
from pacerl.agents.evaluation.benchmarks import MIRROR_ENV, Benchmark, load_benchmark, suite_benchmarks
from pacerl.agents.evaluation.config import EvalConfig
from pacerl.agents.evaluation.play import evaluate, evaluate_served
from pacerl.agents.evaluation.report import EvalReport, transcript
from pacerl.agents.evaluation.suites import SuiteResult, benchmark_eval_config, run_suite
from pacerl.agents.gguf import SHIPPED
from pacerl.agents.models import load_model
from pacerl.agents.tokenizer import with_chat_template
from pacerl.assembly import env_factory, sandbox_settings, seed_everything, training_tasks
from pacerl.config import (
    ConfigError,
    RunConfig,
    config_from_dict,
    config_json,
    model_defaults,
    model_warnings,
)
from pacerl.display import EpisodeDisplay
from pacerl.envs import Task, ToolEnv
from pacerl.envs.registry import env_class
from pacerl.envs.tasks import hold_out
from pacerl.settings import apply_overrides, config_to_dict, merge_settings, read_settings
from pacerl.train import quiet_logging

log = logging.getLogger(__name__)

_FLAG_KEYS = {
    "model": ("model", "path"),
    "env_id": ("env", "id"),
    "tasks": ("evaluation", "tasks"),
    "n": ("evaluation", "settings", "samples"),
    "temperature": ("evaluation", "settings", "temperature"),
    "max_tasks": ("evaluation", "settings", "max_tasks"),
    "retriever_url": ("env", "retriever_url"),
}
"""`main_eval`'s shorthand arguments → the config keys they set (`seed` sets two: see `eval_config`)."""


def eval_config(
    config_path: str | None = None, overrides: Sequence[str] = (), flags: Mapping[str, Any] | None = None
) -> RunConfig:
    """The evaluation's config: `EvalConfig`'s defaults for `evaluation.settings`, a real checkpoint's
    own (`model_defaults`), then the file at `config_path`, then `flags` (`main_eval`'s shorthands, None
    ones left out), then the `key=value` `overrides`; what looks wrong for the model is logged
    (`model_warnings`). ConfigError on any problem, naming the key."""

    given = _given(config_path, overrides, flags)
    defaults = {"evaluation": {"settings": config_to_dict(EvalConfig())}}
    config = config_from_dict(merge_settings(merge_settings(defaults, model_defaults(given)), given))
    for warning in model_warnings(config):
        log.warning("%s", warning)
    return config


def _given(
    config_path: str | None, overrides: Sequence[str], flags: Mapping[str, Any] | None
) -> dict[str, Any]:
    """What the user set, as one settings tree: the file, then the shorthand flags, then `key=value`."""

    data: dict[str, Any] = read_settings(Path(config_path)) if config_path is not None else {}
    shorthand: dict[str, Any] = {}
    for name, value in (flags or {}).items():
        if value is None:
            continue
        keys = [("seed",), ("evaluation", "settings", "seed")] if name == "seed" else [_FLAG_KEYS[name]]
        for key in keys:
            section = shorthand
            for part in key[:-1]:
                section = section.setdefault(part, {})
            section[key[-1]] = value
    return apply_overrides(merge_settings(data, shorthand), overrides)


def main_eval(
    model: str | None = None,
    env_id: str | None = None,
    n: int | None = None,
    tasks: str | None = None,
    out: str | None = None,
    *,
    temperature: float | None = None,
    max_tasks: int | None = None,
    retriever_url: str | None = None,
    seed: int | None = None,
    episodes: str | None = None,
    config_path: str | None = None,
    overrides: Sequence[str] = (),
    suite: str | None = None,
    suite_dir: str | None = None,
    print_config: bool = False,
) -> int:
    """The body of `pacerl eval`: evaluate the model of the config (`model.path`, or the served model of
    `engine_backend=openai`) on its env's held-out tasks (`evaluation.tasks`, default the env's
    validation set) with `evaluation.settings`, or on every benchmark of `suite` (`pacerl.envs.suites`: read
    from `suite_dir`, `$PACERL_BENCHMARK_DIR` or the hub); print the table, write the JSON report (with
    the resolved config under `run_config`) to `out` and each episode's transcript to `episodes`
    (JSONL). The positional and keyword shorthands set config keys (`_FLAG_KEYS`); `overrides` are
    `key=value`. `env.id`: any registered `ToolEnv` id, or `module:Name-v0` for a user's env. What the
    env's tools need is started for the evaluation (`ToolEnv.services`: the Search envs' BM25 retriever,
    in process, unless `env.retriever_url` names one). Bad input (no such directory, unknown env, task
    set or suite, invalid option) raises a one-line ConfigError or OSError before any episode starts.
    `print_config`: only print the resolved config (`config_json`), touching no model."""

    quiet_logging()
    flags = {
        "model": model,
        "env_id": env_id,
        "n": n,
        "tasks": tasks,
        "temperature": temperature,
        "max_tasks": max_tasks,
        "retriever_url": retriever_url,
        "seed": seed,
    }
    try:
        given = _given(config_path, overrides, flags)
        config = eval_config(config_path, overrides, flags)
    except ValueError as error:  # EvalConfig's own checks name their fields
        raise ConfigError(str(error)) from None
    if print_config:
        print(config_json(config), end="")
        return 0
    served = config.engine_backend == "openai"
    if not served and config.model.path is None:
        raise ConfigError("--model: name a model directory (model.path), or evaluate a served model "
                          "with engine_backend=openai")  # fmt: skip
    # Checked here: a missing `a/b` path would be taken for a hub name and fetched from the network.

    shipped = str(config.model.path) in SHIPPED  # a shipped model's short name, e.g. smollm2-135m
    if not served and not shipped and not Path(str(config.model.path)).expanduser().exists():
        raise ConfigError(f"--model: no model directory or .gguf file at {config.model.path}")
    subject = config.model.path if not served else (config.openai.model or config.openai.base_url)
    with contextlib.ExitStack() as stack:
        transcripts = stack.enter_context(_open_for_writing(episodes)) if episodes is not None else None

        def keep(lines: Sequence[dict[str, Any]]) -> None:
            if transcripts is not None:
                for line in lines:
                    transcripts.write(json.dumps(line) + "\n")

        if suite is not None:
            result = _run_suite(config, given, suite, suite_dir, str(subject), keep)
            print(result.table(), end="")
            data = {**result.to_json(), "markdown": result.markdown(), "run_config": config_to_dict(config)}
            reports = [(r.benchmark.name, r.report) for r in result.results]
        else:
            report = _run_env(config, str(subject), keep)
            print(report.table(), end="")
            data = {**report.to_json(), "run_config": config_to_dict(config)}
            reports = [(str(config.env.id), report)]
    if episodes is not None:
        print(f"wrote the episodes to {episodes}")
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    for name, evaluated in reports:  # written first, but a pipeline must not take this for a score
        if evaluated.failed_episodes == evaluated.episodes:
            ending = max(evaluated.failures, key=lambda key: evaluated.failures[key])
            raise RuntimeError(
                " ".join(
                    f"every episode of {name} failed ({evaluated.episodes} of {evaluated.episodes}, "
                    f"e.g. {ending}): its scores measure the failure, not the model".split()
                )
            )
    return 0


def _run_env(config: RunConfig, subject: str, keep: Callable[[Sequence[dict[str, Any]]], None]) -> EvalReport:
    """The evaluation of `config.env` on its held-out tasks."""

    spec = config.env
    try:
        cls = env_class(spec.id)
    except ValueError as error:
        raise ConfigError(f"--env: {error}") from None
    source = config.evaluation.tasks
    source = source if source is not None else cls.validation_tasks_for(spec.tasks)
    if source is not None:
        config = replace(config, env=replace(spec, tasks=source))
        make_env = env_factory(config)  # a bad env or task set fails here, before the model loads
    else:  # the tasks a run of this config held out of training (`held_out_of_training`)
        every = training_tasks(env_factory(config))
        try:
            held = hold_out(every, config.seed)[1]
        except ValueError as error:
            raise ConfigError(
                f"--tasks: {spec.id} ships no validation set and {error}; name a task file (--tasks)"
            ) from None
        make_env = env_factory(config, tasks=held)
        source = f"{len(held)} of its {len(every)} tasks held out of training, seed {config.seed}"
        print(f"{spec.id} ships no validation set: evaluating on {source}", file=sys.stderr)
    seed_everything(config)
    given = {"retriever_url": spec.retriever_url} if spec.retriever_url else {}
    with cls.services(given) as started:
        if started:
            make_env = with_settings(make_env, started)
        label = f"{subject} on {spec.id} ({source})"
        return _run_eval(config, make_env, config.evaluation.settings, label, keep, {})


_SUITE_DIR_HINT = (
    "--suite-dir DIR, a directory holding {name}.parquet (or {name}/, a hub snapshot), or "
    f"{MIRROR_ENV}=DIR"
)
"""How a user of `pacerl eval --suite` gives a benchmark's local copy."""


def _run_suite(
    config: RunConfig,
    given: Mapping[str, Any],
    suite: str,
    suite_dir: str | None,
    subject: str,
    keep: Callable[[Sequence[dict[str, Any]]], None],
) -> SuiteResult:
    """Every benchmark of `suite`, each in its scoring env with that env's own prompt and limits and
    the benchmark's sampling (`Benchmark.eval_settings`), under what the user set explicitly (`given`:
    `evaluation.settings.*`, `env.system_prompt`, `env.max_turns`, `env.max_tool_calls` win)."""

    try:
        members = suite_benchmarks(suite)
        benchmark_tasks = {
            b.name: load_benchmark(b, mirror=suite_dir, local_copy=_SUITE_DIR_HINT) for b in members
        }  # read before any run
    except ValueError as error:
        raise ConfigError(f"--suite {suite}: {error}") from None
    chosen_settings = given.get("evaluation", {}).get("settings", {})
    user_settings = {key: getattr(config.evaluation.settings, key) for key in chosen_settings}
    chosen_env = given.get("env", {})
    env_keys = ("system_prompt", "max_turns", "max_tool_calls")
    user_env = {key: getattr(config.env, key) for key in env_keys if key in chosen_env}
    sampling = {}  # each benchmark's settings, checked before any run
    for benchmark in members:
        try:
            sampling[benchmark.name] = benchmark_eval_config(
                benchmark, config.evaluation.settings, user_settings
            )
        except ValueError as error:
            raise ConfigError(f"--suite {suite}: {benchmark.name}: {error}") from None
    seed_everything(config)
    loaded: dict[str, tuple[Any, Any]] = {}  # the model, loaded once for every benchmark
    order = {benchmark.name: index for index, benchmark in enumerate(members, start=1)}

    def evaluate_benchmark(benchmark: Benchmark) -> EvalReport:
        cls = env_class(benchmark.env_id)
        settings = sampling[benchmark.name]
        service = {"retriever_url": config.env.retriever_url} if config.env.retriever_url else {}
        with cls.services(service) as started:
            options = replace(cls.default_config(), **user_env)
            posed = {**options.settings, **benchmark.env_settings}  # the benchmark's prompt form
            tools = {**posed, **sandbox_settings(config), **service, **started}
            options = replace(options, settings=tools)
            tasks = benchmark_tasks[benchmark.name]

            def make_env() -> ToolEnv:
                return cls(tasks=tasks, config=options)

            def tagged(lines: Sequence[dict[str, Any]]) -> None:
                keep([{"benchmark": benchmark.name, **line} for line in lines])

            position = f"{benchmark.name} ({order[benchmark.name]}/{len(members)})"  # where the suite is
            label = f"{subject} on {benchmark.title}"
            return _run_eval(config, make_env, settings, label, tagged, loaded, progress=f"eval {position}")

    return run_suite(suite, evaluate_benchmark, label=subject)


@contextlib.contextmanager
def _open_for_writing(path: str) -> Iterator[TextIO]:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w", encoding="utf-8") as handle:
        yield handle


def _run_eval(
    config: RunConfig,
    make_env: Callable[[], ToolEnv],
    settings: EvalConfig,
    label: str,
    keep: Callable[[Sequence[dict[str, Any]]], None],
    loaded: dict[str, tuple[Any, Any]],
    *,
    progress: str = "eval",
) -> EvalReport:
    """Evaluate on the tasks `make_env`'s envs hold, sampled as `settings` say, with the engine
    `config.engine_backend` names: the embedded engine serving `model.path`, an SGLang server, or a
    served chat-completions model; the progress display is labelled `progress`."""

    async def run() -> EvalReport:
        probe = make_env()  # the tasks exactly as the env loaded them (as `pacerl train` takes them)
        tasks = probe.tasks
        probe.close()
        chosen = len(tasks) if settings.max_tasks is None else min(len(tasks), settings.max_tasks)
        with EpisodeDisplay(progress, chosen * settings.samples) as display:
            if config.engine_backend == "openai":
                return await _served(config, make_env, tasks, settings, label, keep, display)
            return await _local(config, make_env, tasks, settings, label, keep, loaded, display)

    return asyncio.run(run())


async def _served(
    config: RunConfig,
    make_env: Callable[[], ToolEnv],
    tasks: Sequence[Task],
    settings: EvalConfig,
    label: str,
    keep: Callable[[Sequence[dict[str, Any]]], None],
    progress: EpisodeDisplay,
) -> EvalReport:

    options = config.openai
    if settings.top_k > 0:  # not a parameter of the OpenAI API; SGLang and vLLM read it from the body
        options = replace(options, extra_body={"top_k": settings.top_k, **options.extra_body})
    client = OpenAIChatClient(options)
    try:
        return await evaluate_served(
            client,
            make_env,
            tasks,
            settings,
            label=label,
            on_group=lambda group: keep([episode.to_json() for episode in group]),
            on_episode=progress.episode,
        )
    finally:
        await client.aclose()


async def _local(
    config: RunConfig,
    make_env: Callable[[], ToolEnv],
    tasks: Sequence[Task],
    settings: EvalConfig,
    label: str,
    keep: Callable[[Sequence[dict[str, Any]]], None],
    loaded: dict[str, tuple[Any, Any]],
    progress: EpisodeDisplay,
) -> EvalReport:
    """The embedded engine or an SGLang server; `loaded` keeps the model across a suite's benchmarks."""

    assert config.model.path is not None  # checked by main_eval
    if config.model.path not in loaded:
        loaded[config.model.path] = _load(config.model.path)
    policy, tokenizer = loaded[config.model.path]
    engine: Engine
    if config.engine_backend == "sglang":
        # Nothing is published during an evaluation, so no weights directory is needed.
        engine = SGLangEngine(replace(config.sglang, base_model_dir=config.model.path))
    else:
        engine = EmbeddedEngine(policy, tokenizer, replace(config.engine, seed=settings.seed))
    try:
        # Routes are not recorded in eval, so the model's expert count is not needed.
        return await evaluate(
            engine,
            tokenizer,
            make_env,
            tasks,
            settings,
            label=label,
            on_group=lambda group: keep([transcript(t, tokenizer) for t in group]),
            on_episode=progress.episode,
        )
    finally:
        await engine.aclose()


def _load(model: str) -> tuple[Any, Any]:

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
