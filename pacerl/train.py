"""`pacerl train`: build a run from its config (model, engine, env, driver, learner, pool) and drive the
sync or async loop; checkpoints on the way, at the end, and on Ctrl-C; `--resume RUN_DIR` continues.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from transformers.utils import logging as transformers_logging

from pacerl.agents.models import save_model
from pacerl.assembly import (
    TOKENIZER_DIR,
    WarmStartInterruptedError,
    background_evaluator,
    build_run,
    env_factory,
    held_out_of_training,
    load_policy,
    seed_everything,
    training_tasks,
    warm_start,
)
from pacerl.config import ConfigError, RunConfig, config_json, load_config, save_config
from pacerl.display import StepDisplay
from pacerl.envs.registry import env_class
from pacerl.lab.emulated import clock_config, train_emulated
from pacerl.parallel import is_learner_rank, serve_rank
from pacerl.plots import plot_run
from pacerl.trainer.checkpoint import latest_checkpoint, load_checkpoint
from pacerl.trainer.host_memory import peak_rss_gb
from pacerl.trainer.loop import Run, train_async, train_sync

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"


async def train(config: RunConfig, *, resume: bool = False) -> dict[str, Any]:
    """Run training to `config.loop.steps` (continuing the run directory's latest checkpoint when
    `resume`); a run that updated the weights in none of its steps says so under `failure` in the
    summary (`loop.require_update`). Ctrl-C or SIGTERM saves a checkpoint and returns early. What the
    env's tools need is started for the run (`ToolEnv.services`: the Search env's retriever unless
    `env.retriever_url` names one)."""
    if config.learner.parallel == "fsdp" and config.runtime != "ray" and is_learner_rank():
        serve_rank()  # a torchrun rank > 0: rank 0 runs the run, this rank holds a shard of the learner
        return {}
    if config.engine_backend == "openai":
        raise ConfigError(
            "config: engine_backend=openai serves evaluation only (`pacerl eval`): a chat-completions server "
            "returns text, not the token ids and log-probs training needs; train with embedded or sglang"
        )
    if config.emulation.clock == "emulated":
        if resume:
            raise ConfigError(
                "--resume: an emulated run saves no state of its clock, so it cannot be resumed"
            )
        _emulated_loop(config)  # what the clock cannot run fails here, before anything is written
    try:
        cls = env_class(config.env.id)
        config.sft.resolved(config.env.id)
    except ValueError as error:
        raise ConfigError(f"config: {error}") from None
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
    model, tokenizer = load_policy(config, run_dir / TOKENIZER_DIR if resume else None)
    make_env = env_factory(config)  # an unknown env or task file fails here, before anything is written
    tasks, held_out = held_out_of_training(config, training_tasks(make_env))
    _prepare_run_dir(run_dir, fresh=not resume)
    save_config(saved, run_dir / CONFIG_FILE)
    if config.model.path is None and not resume:  # the tiny tokenizer is rebuilt from code: keep this one
        tokenizer.save_pretrained(run_dir / TOKENIZER_DIR)
    warmed: dict[str, float] = {}
    if checkpoint is None:
        stop = threading.Event()
        warm_started = time.monotonic()
        with _signals_set(stop):
            warmed = await asyncio.to_thread(warm_start, config, model, tokenizer, tasks, stop=stop)
        if warmed:
            warmed["sft/seconds"] = time.monotonic() - warm_started
            save_model(model, tokenizer, run_dir / "warm_start")
            style, steps = config.sft.resolved(config.env.id)
            first, last = warmed["sft/first_loss"], warmed["sft/last_loss"]
            log.info("SFT warm start (%s, %d steps): loss %.3f -> %.3f", style, steps, first, last)
    run = build_run(config, run_dir, model, tokenizer, make_env, tasks)
    if checkpoint is not None:
        await run.restore(checkpoint)
    loop: Callable[[Run], Coroutine[Any, Any, dict[str, Any]]] = (
        train_sync if config.loop.mode == "sync" else train_async
    )
    if config.emulation.clock == "emulated":
        loop = _emulated_loop(config)
    evaluator = None
    if config.evaluation.every or config.evaluation.at_start or config.evaluation.at_end:
        evaluator = background_evaluator(
            config, model, tokenizer, run.learner.version, make_env, held_out=held_out
        )
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
    if warmed:
        summary["warm_start"] = warmed
    summary["peak_rss_gb"] = peak_rss_gb()
    nothing = None if run.stopping else run.trained_nothing()
    if nothing is not None:  # `pacerl train` exits 2 with it: a pipeline must not take it for success
        summary["failure"] = nothing
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return summary


def _emulated_loop(config: RunConfig) -> Callable[[Run], Coroutine[Any, Any, dict[str, Any]]]:
    """The loop of `emulation.clock = "emulated"`: `config.loop`'s mode under the clock of
    `config.emulation` (`pacerl.lab.emulated`); ConfigError for a clock that cannot run."""
    spec, loop = config.emulation, config.loop
    try:
        clock = clock_config(
            spec.preset,
            inference_gpus=spec.inference_gpus,
            trainer_gpus=spec.trainer_gpus,
            token_scale=spec.token_scale,
            mode=loop.mode,
            steps=loop.steps,
            batch_groups=loop.batch_groups,
            sync_interval=loop.sync_interval,
            group_size=config.rollout.group_size,
            max_total_tokens=config.rollout.max_total_tokens,
            filter_config=config.filter,
            seed=config.seed,
        )
    except ValueError as error:
        raise ConfigError(f"config: emulation: {error}") from None
    return functools.partial(
        train_emulated,
        config=clock,
        mode=loop.mode,
        token_scale=spec.token_scale,
        max_gpu_hours=spec.max_gpu_hours,
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


def main_train(
    config_path: str | None, overrides: list[str], resume: str | None, *, print_config: bool = False
) -> int:
    """The body of `pacerl train`; with `print_config`, only print the resolved config (`config_json`)."""
    quiet_logging()
    if resume is not None:
        saved = Path(resume) / CONFIG_FILE
        if not saved.is_file():
            raise ConfigError(f"--resume {resume}: no {CONFIG_FILE} there (is it a run directory?)")
        config = load_config(saved, [*overrides, f"run_dir={resume}"])
    else:
        config = load_config(config_path, overrides)
    if print_config:
        print(config_json(config), end="")
        return 0
    try:
        summary = asyncio.run(train(config, resume=resume is not None))
        if not summary:  # a learner rank > 0 of a torchrun launch: rank 0 reports
            return 0
    except WarmStartInterruptedError as stopped:
        print(
            f"pacerl train: {stopped}; nothing was checkpointed, run it again to start over", file=sys.stderr
        )
        return 130
    print(report(summary, Path(config.run_dir)))
    if summary.get("failure"):
        print(f"pacerl: error: {summary['failure']} (loop.require_update)", file=sys.stderr)
        return 2
    return 0


def report(summary: Mapping[str, Any], run_dir: Path) -> str:
    """The few lines `pacerl train` ends with: steps, time, validation accuracy from first to last
    evaluation, and where the outputs are."""
    lines = [
        f"trained {summary['step']} steps (policy version {summary['version']}) in {summary['seconds']:.0f} s"
        + (f", peak memory {summary['peak_rss_gb']:.1f} GB" if "peak_rss_gb" in summary else "")
    ]
    evaluations = summary.get("evaluations") or []
    if evaluations:
        first, last = evaluations[0], evaluations[-1]
        gain = 100 * (last["eval/accuracy"] - first["eval/accuracy"])
        lines.append(
            f"validation accuracy {first['eval/accuracy']:.3f} (step {first['step']}) -> "
            f"{last['eval/accuracy']:.3f} (step {last['step']}), {gain:+.1f} points"
        )
        for key in sorted(k for k in last if k.startswith("eval/") and k.count("/") == 2):
            if key.endswith("/accuracy") and key in first:  # a further set (`evaluation.extra_tasks`)
                gain = 100 * (last[key] - first[key])
                lines.append(
                    f"  {key.split('/')[1]}: {first[key]:.3f} -> {last[key]:.3f}, {gain:+.1f} points"
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


HTTP_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "openai")
"""The HTTP clients' loggers: httpx and httpx2 (the openai client's) log a line per request at INFO,
openai one per retried request."""


def quiet_logging() -> None:
    """pacerl's own progress lines; the HTTP clients' per-request lines only when something fails, or
    always with `PACERL_LOG_HTTP=1` (to see what a served evaluation sends)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    http_level = logging.INFO if os.environ.get("PACERL_LOG_HTTP") == "1" else logging.WARNING
    for name in HTTP_LOGGERS:
        logging.getLogger(name).setLevel(http_level)
    logging.getLogger("tensorboardX").setLevel(logging.WARNING)
    # transformers' save_pretrained bar would interleave with ours
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
