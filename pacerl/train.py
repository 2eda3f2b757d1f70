"""`pacerl train`: build a run from its config (model, engine, env, driver, learner, pool) and drive the
sync or async loop; checkpoints on the way, at the end, and on Ctrl-C; `--resume RUN_DIR` continues.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Self, cast

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging as transformers_logging

from agents.engine.embedded import EmbeddedEngine
from agents.engine.protocol import Engine
from agents.engine.sglang import SGLangEngine
from agents.evaluation import evaluate
from agents.models import build_tiny_moe, load_model, moe_info, save_model
from agents.rollout import EpisodeEnv, RolloutDriver
from agents.tokenizer import tiny_tokenizer
from envs import Task, ToolEnv, load_tasks
from envs.registry import env_class
from pacerl.config import ConfigError, RunConfig, load_config, save_config
from pacerl.plots import plot_run
from trainer.checkpoint import latest_checkpoint, load_checkpoint
from trainer.learner import Learner, LearnerLike
from trainer.loop import Run, train_async, train_sync
from trainer.pool import TrajectoryPool
from trainer.sft import SFTConfig, demonstrations, sft

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"


def env_factory(config: RunConfig) -> Callable[[], ToolEnv]:
    """A maker of fresh, unwrapped envs of `config.env` (the driver needs `astep` and the tool schemas,
    which Gymnasium's wrappers hide)."""
    spec = config.env
    try:
        cls = env_class(spec.id)
    except ValueError as error:
        raise ConfigError(f"config: env.id: {error}") from None
    tasks = load_tasks(spec.tasks) if spec.tasks is not None else None
    takes_tasks = inspect.signature(cls).parameters.get("tasks")
    if tasks is None and takes_tasks is not None and takes_tasks.default is inspect.Parameter.empty:
        raise ConfigError(
            f"config: env.tasks: {spec.id} has no default tasks: name a task file or shipped set"
        )
    options = replace(
        cls.default_config(),
        max_turns=spec.max_turns,
        max_tool_calls=spec.max_tool_calls,
        system_prompt=spec.system_prompt,
    )
    if spec.retriever_url is not None:
        options = replace(options, settings={**options.settings, "retriever_url": spec.retriever_url})

    env_id = spec.id  # the maker holds nothing of pacerl.config: Ray env workers unpickle it without torch

    def make() -> ToolEnv:
        env = cls(tasks=tasks, config=options) if tasks is not None else cast(Any, cls)(config=options)
        if not isinstance(env, ToolEnv):
            raise TypeError(f"{env_id} made a {type(env).__name__}, not a ToolEnv")
        return env

    return make


def load_policy(config: RunConfig) -> tuple[Any, PreTrainedTokenizerBase]:
    """The model to train and its tokenizer: built from `model.tiny`, or loaded from `model.path`."""
    if config.model.path is None:
        tokenizer = tiny_tokenizer()
        return build_tiny_moe(config.model.tiny, tokenizer), tokenizer
    try:
        return load_model(config.model.path)
    except (FileNotFoundError, ValueError, OSError) as error:
        raise ConfigError(f"config: model.path: {error}") from None


def training_tasks(make_env: Callable[[], ToolEnv]) -> list[Task]:
    """The tasks the envs of `make_env` draw from (read from one env, closed again)."""
    env = make_env()
    try:
        return list(env.tasks)
    finally:
        env.close()


def build_run(
    config: RunConfig,
    run_dir: Path,
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    make_env: Callable[[], ToolEnv],
    tasks: Sequence[Task],
) -> Run:
    """Every part of a run, wired as `config` says (nothing runs yet, but with `runtime = "ray"` the
    actors are up)."""
    engine: Engine
    learner: LearnerLike
    make_episode: Callable[[], EpisodeEnv] = make_env
    runtime = None
    if config.runtime == "ray":
        try:
            from pacerl.runtime_ray import RayRuntime  # Ray is an optional extra
        except ImportError as error:
            raise ConfigError(f"runtime=ray needs Ray ({error}): pip install 'pacerl[ray]'") from None
        runtime = RayRuntime(config, run_dir, model, tokenizer, make_env)
        engine, learner, make_episode = runtime.engine, runtime.learner, runtime.make_env
    elif config.engine_backend == "sglang":
        options = replace(
            config.sglang,
            weights_dir=config.sglang.weights_dir or str(run_dir / "weights"),
            base_model_dir=config.sglang.base_model_dir or config.model.path,
        )
        engine = SGLangEngine(options)
    else:
        engine = EmbeddedEngine(build_twin(model), tokenizer, config.engine)
    if runtime is None:
        learner = Learner(model, config.learner, pad_id=int(tokenizer.pad_token_id or 0))
    driver = RolloutDriver(engine, tokenizer, make_episode, config.rollout, num_experts=_num_experts(model))
    run = Run(
        learner=learner,
        engine=engine,
        driver=driver,
        tasks=tasks,
        pool=TrajectoryPool(config.filter),
        config=config.loop,
        run_dir=run_dir,
    )
    if runtime is not None:
        runtime.attach(run)
    return run


class WarmStartInterruptedError(Exception):
    """Ctrl-C (or SIGTERM) during the SFT warm start: nothing to resume yet, the run starts over."""


def warm_start(
    config: RunConfig,
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    *,
    stop: threading.Event | None = None,
) -> dict[str, float]:
    """Run the configured SFT on `model` if `config.sft` asks for it (demonstrating `sft.tasks`, else
    `tasks`, the training tasks); its first and last loss. A progress bar on a terminal, a log line
    every tenth of the steps otherwise. Setting `stop` ends it after the current step with
    `WarmStartInterruptedError`."""
    spec = config.sft
    fresh = config.model.path is None
    style, steps = spec.resolved(config.env.id)
    if steps == 0 or spec.when == "never" or (spec.when == "fresh" and not fresh):
        return {}
    if spec.tasks is not None:
        tasks = load_tasks(spec.tasks)
    demos = demonstrations(
        config.env.id,
        tasks,
        seed=config.seed,
        style=style,
        system_prompt=config.env.system_prompt,
        tool_schemas=config.rollout.tool_schemas_in_prompt,
        tokenizer=tokenizer,
    )
    sft_config = SFTConfig(lr=spec.lr, steps=steps, batch_size=spec.batch_size, seed=config.seed)
    with ProgressDisplay(f"sft ({style})", steps, 0) as display:

        def on_step(step: int, loss: float) -> bool:
            display.show(step + 1, f"loss {loss:.3f}")
            return stop is not None and stop.is_set()

        losses = sft(model, demos, sft_config, on_step=on_step)
    if stop is not None and stop.is_set():
        raise WarmStartInterruptedError(
            f"interrupted during the SFT warm start at step {len(losses)} of {steps}"
        )
    return {"sft/first_loss": losses[0], "sft/last_loss": losses[-1], "sft/steps": float(len(losses))}


def seed_everything(config: RunConfig) -> None:
    """Threads and seeds of torch, numpy and python."""
    torch.set_num_threads(config.threads)
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)


def build_twin(model: Any) -> Any:
    """The engine's own copy of the trained model: generation goes on while the learner updates its
    weights, so the two cannot share parameters; weights reach the engine only by publication."""
    twin = type(model)(model.config)
    twin.load_state_dict(model.state_dict())
    return twin.eval()


async def train(config: RunConfig, *, resume: bool = False) -> dict[str, Any]:
    """Run training to `config.loop.steps` (continuing the run directory's latest checkpoint when
    `resume`). Ctrl-C or SIGTERM saves a checkpoint and returns early. What the env's tools need is
    started for the run (`ToolEnv.services`: the Search env's retriever unless `env.retriever_url` names
    one)."""
    try:
        cls = env_class(config.env.id)
        config.sft.resolved(config.env.id)
    except ValueError as error:
        raise ConfigError(f"config: {error}") from None
    evaluations = config.evaluation.every or config.evaluation.at_start or config.evaluation.at_end
    if evaluations and config.evaluation.tasks is None and cls.validation_tasks is None:
        raise ConfigError(
            f"config: evaluation.tasks: {config.env.id} ships no validation set: name a task file, or turn "
            "evaluation off (evaluation.every=0 evaluation.at_start=false evaluation.at_end=false)"
        )
    settings = {"retriever_url": config.env.retriever_url} if config.env.retriever_url else {}
    with cls.services(settings) as started:
        served = config
        if started.get("retriever_url"):
            served = replace(config, env=replace(config.env, retriever_url=str(started["retriever_url"])))
        return await _train(served, resume=resume, saved=config)


async def _train(config: RunConfig, *, resume: bool, saved: RunConfig) -> dict[str, Any]:
    """`train` with everything resolved; `saved` is the config written to the run directory."""
    started = time.monotonic()
    run_dir = Path(config.run_dir)
    checkpoint = None
    if resume:  # read and check everything before anything in the run directory is written
        path = latest_checkpoint(run_dir / "checkpoints")
        if path is None:
            raise ConfigError(f"--resume: {run_dir} has no checkpoint to resume from")
        checkpoint = load_checkpoint(path)
    seed_everything(config)
    model, tokenizer = load_policy(config)
    make_env = env_factory(config)  # an unknown env or task file fails here, before anything is written
    tasks = training_tasks(make_env)
    _prepare_run_dir(run_dir, fresh=not resume)
    save_config(saved, run_dir / CONFIG_FILE)
    if checkpoint is None:
        stop = threading.Event()
        with _signals_set(stop):
            warmed = await asyncio.to_thread(warm_start, config, model, tokenizer, tasks, stop=stop)
        if warmed:
            save_model(model, tokenizer, run_dir / "warm_start")
            style, steps = config.sft.resolved(config.env.id)
            first, last = warmed["sft/first_loss"], warmed["sft/last_loss"]
            log.info("SFT warm start (%s, %d steps): loss %.3f -> %.3f", style, steps, first, last)
    run = build_run(config, run_dir, model, tokenizer, make_env, tasks)
    if checkpoint is not None:
        await run.restore(checkpoint)
    loop = train_sync if config.loop.mode == "sync" else train_async
    evaluator = None
    if config.evaluation.every or config.evaluation.at_start or config.evaluation.at_end:
        evaluator = BackgroundEvaluator(config, model, tokenizer, run.learner.version, make_env)
        run.after_step.append(evaluator.hook)
    try:
        if evaluator is not None and config.evaluation.at_start and run.step == 0:
            await evaluator.now(run)
        job = asyncio.ensure_future(loop(run))
        _on_interrupt(run, job)
        with StepDisplay(config.loop.steps, run.step) as display:
            run.on_record = display.update
            summary = await job
        if evaluator is not None and config.evaluation.at_end and not run.stopping:
            await evaluator.now(run)
    finally:
        if evaluator is not None:
            await evaluator.aclose()
        run.close_metrics()
        await run.release()  # Ray: the trained weights come back into `model`, the actors stop
    save_model(model, tokenizer, run_dir / "model")  # what `pacerl eval --model` reads
    summary["plots"] = [str(path) for path in await asyncio.to_thread(plot_run, run_dir)]
    if evaluator is not None:
        summary["evaluations"] = evaluator.reports
    if run.stopping:
        log.warning("stopped at step %d with a checkpoint; continue with --resume %s", run.step, run_dir)
        summary["interrupted"] = True
    summary["seconds"] = time.monotonic() - started
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return summary


class BackgroundEvaluator:
    """Scores snapshots of the trained weights on held-out tasks with its own engine while training goes
    on; each result is written to the run's metrics as `eval/*` at the step it started, labelled with
    the policy version it evaluated."""

    def __init__(
        self,
        config: RunConfig,
        model: Any,
        tokenizer: PreTrainedTokenizerBase,
        version: int,
        make_env: Callable[[], ToolEnv],
    ) -> None:
        self.spec = config.evaluation
        self.tokenizer = tokenizer
        self.engine = EmbeddedEngine(build_twin(model), tokenizer, version=version)
        self.make_env = make_env
        source = self.spec.tasks or env_class(config.env.id).validation_tasks
        if source is None:
            raise ConfigError(
                f"config: evaluation.tasks: {config.env.id} ships no validation set: name a task file, or "
                "turn evaluation off (evaluation.every=0 evaluation.at_start=false evaluation.at_end=false)"
            )
        self.tasks = load_tasks(source)
        self.num_experts = _num_experts(model)
        self.running: asyncio.Task[None] | None = None
        self.reports: list[dict[str, Any]] = []

    async def hook(self, run: Run) -> None:
        """After a step: start an evaluation of the current weights if one is due and none runs."""
        every = self.spec.every
        due = every > 0 and run.step % every == 0 and run.step < run.config.steps
        if due and (self.running is None or self.running.done()):
            await self._snapshot(run)
            self.running = asyncio.ensure_future(self._evaluate(run, run.step))

    async def now(self, run: Run) -> None:
        """Evaluate the current weights and wait for the result (at the start and the end)."""
        if self.running is not None:
            await self.running
        await self._snapshot(run)
        await self._evaluate(run, run.step)

    async def _snapshot(self, run: Run) -> None:
        if run.learner.version > self.engine.version:
            await self.engine.update_weights(run.learner.weights(), run.learner.version)

    async def _evaluate(self, run: Run, step: int) -> None:
        version = self.engine.version
        report = await evaluate(
            self.engine,
            self.tokenizer,
            self.make_env,
            self.tasks,
            self.spec.settings,
            num_experts=self.num_experts,
            label=f"step {step}, version {version}",
        )
        scalars = {
            "eval/accuracy": report.avg_at_k,
            "eval/mean_reward": report.mean_reward,
            "eval/tool_call_rate": report.tool_call_rate,
            "eval/version": float(version),
            **{f"eval/pass_at_{k}": value for k, value in report.pass_at_k.items()},
        }
        run.metrics.write(step, scalars)
        self.reports.append({"step": step, "version": version, **scalars})
        log.info("eval at step %d (version %d): accuracy %.3f", step, version, report.avg_at_k)

    async def aclose(self) -> None:
        if self.running is not None:
            self.running.cancel()
            await asyncio.gather(self.running, return_exceptions=True)
        await self.engine.aclose()


def _num_experts(model: Any) -> int:
    """Experts per MoE layer, 0 for a dense model (whose engine records no routes)."""
    try:
        return moe_info(model).num_experts
    except ValueError:
        return 0


class ProgressDisplay:
    """A progress bar labelled `label` with a status text on a terminal; without one (CI logs, pipes) a
    log line at the first step, every `log_every` steps (default: a tenth of the total) and at the last."""

    def __init__(self, label: str, total: int, done: int, *, log_every: int | None = None) -> None:
        self.interactive = sys.stderr.isatty()
        self.label, self.total = label, total
        self.log_every = log_every or max(1, total // 10)
        self.progress = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            disable=not self.interactive,
        )
        self.task = self.progress.add_task(label, total=total, completed=done, status="")

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def show(self, step: int, status: str) -> None:
        self.progress.update(self.task, completed=step, status=status)
        if not self.interactive and (step in (1, self.total) or step % self.log_every == 0):
            log.info("%s step %d/%d  %s", self.label, step, self.total, status)


class StepDisplay(ProgressDisplay):
    """The training bar: the step's reward, accuracy, staleness and pool occupancy; one log line per
    step without a terminal."""

    def __init__(self, total: int, done: int) -> None:
        super().__init__("train", total, done, log_every=1)

    def update(self, step: int, scalars: Mapping[str, float]) -> None:
        self.show(
            step,
            f"reward {scalars.get('reward', 0.0):.2f}  acc {scalars.get('accuracy', 0.0):.2f}  "
            f"staleness {scalars.get('staleness/mean_staleness', 0.0):.2f}  "
            f"pool {scalars.get('pool_groups', 0.0):.0f}  v{scalars.get('version', 0.0):.0f}",
        )


@contextlib.contextmanager
def _signals_set(event: threading.Event) -> Iterator[None]:
    """While inside, Ctrl-C and SIGTERM set `event` instead of interrupting the event loop (work in a
    thread checks it and ends cleanly)."""
    installed = _on_stop_signals(event.set)
    try:
        yield
    finally:
        for sig in installed:
            asyncio.get_running_loop().remove_signal_handler(sig)


def _on_stop_signals(callback: Callable[[], None]) -> list[signal.Signals]:
    """Run `callback` on Ctrl-C and SIGTERM (on the running loop); the signals it could take."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, callback)
            installed.append(sig)
    return installed


def _on_interrupt(run: Run, job: asyncio.Future[Any]) -> None:
    """The first Ctrl-C (or SIGTERM) ends the run after its current step with a checkpoint; a second
    one cancels at once."""

    def interrupt() -> None:
        if run.stopping:
            job.cancel()
        run.request_stop()

    _on_stop_signals(interrupt)


def _prepare_run_dir(run_dir: Path, *, fresh: bool) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".writable"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"run_dir {run_dir} is not writable ({error.strerror}); choose another") from None
    if fresh and (run_dir / "checkpoints").exists():
        raise ConfigError(
            f"run_dir {run_dir} already holds a run; pass --resume to continue it or choose another run_dir"
        )


def main_train(config_path: str | None, overrides: list[str], resume: str | None) -> int:
    """The body of `pacerl train`."""
    quiet_logging()
    if resume is not None:
        saved = Path(resume) / CONFIG_FILE
        if not saved.is_file():
            raise ConfigError(f"--resume {resume}: no {CONFIG_FILE} there (is it a run directory?)")
        config = load_config(saved, [*overrides, f"run_dir={resume}"])
    else:
        config = load_config(config_path, overrides)
    try:
        summary = asyncio.run(train(config, resume=resume is not None))
    except WarmStartInterruptedError as stopped:
        print(
            f"pacerl train: {stopped}; nothing was checkpointed, run it again to start over", file=sys.stderr
        )
        return 130
    print(report(summary, Path(config.run_dir)))
    return 0


def report(summary: Mapping[str, Any], run_dir: Path) -> str:
    """The few lines `pacerl train` ends with: steps, time, validation accuracy from first to last
    evaluation, and where the outputs are."""
    lines = [
        f"trained {summary['step']} steps (policy version {summary['version']}) in {summary['seconds']:.0f} s"
    ]
    evaluations = summary.get("evaluations") or []
    if evaluations:
        first, last = evaluations[0], evaluations[-1]
        gain = 100 * (last["eval/accuracy"] - first["eval/accuracy"])
        lines.append(
            f"validation accuracy {first['eval/accuracy']:.3f} (step {first['step']}) -> "
            f"{last['eval/accuracy']:.3f} (step {last['step']}), {gain:+.1f} points"
        )
    lines.append(f"run directory {run_dir}: {SUMMARY_FILE}, metrics.jsonl, tb/, plots/, checkpoints/, model/")
    if summary.get("interrupted"):
        lines.append(f"stopped early; continue with: pacerl train --resume {run_dir}")
    return "\n".join(lines)


def main_sft(config_path: str | None, overrides: list[str], out: str) -> int:
    """The body of `pacerl sft`: the warm start of `config` (whatever `sft.when` says), saved to `out`."""
    quiet_logging()
    config = load_config(config_path, [*overrides, "sft.when=always"])
    destination = Path(out)
    if destination.exists() and any(destination.iterdir()):
        raise ConfigError(f"--out {out} is not empty; choose a new directory")
    seed_everything(config)
    model, tokenizer = load_policy(config)
    try:
        stats = warm_start(config, model, tokenizer, training_tasks(env_factory(config)))
    except KeyboardInterrupt:
        print("pacerl sft: interrupted; nothing was saved", file=sys.stderr)
        return 130
    save_model(model, tokenizer, destination)
    print(
        f"SFT {stats.get('sft/steps', 0):.0f} steps, loss {stats.get('sft/first_loss', float('nan')):.3f} -> "
        f"{stats.get('sft/last_loss', float('nan')):.3f}; model saved to {destination}"
    )
    return 0


def quiet_logging() -> None:
    """pacerl's own progress lines; the HTTP clients' per-request lines only when something fails."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("httpx", "httpcore", "tensorboardX"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # transformers' save_pretrained bar would interleave with ours
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
