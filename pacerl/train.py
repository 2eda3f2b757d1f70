"""`pacerl train`: build a run from its config (model, engine, env, driver, learner, pool) and drive the
sync or async loop; checkpoints on the way, at the end, and on Ctrl-C; `--resume RUN_DIR` continues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from agents.engine.embedded import EmbeddedEngine
from agents.engine.protocol import Engine
from agents.engine.sglang import SGLangEngine
from agents.models import build_tiny_moe, load_model, moe_info
from agents.rollout import RolloutDriver
from agents.tokenizer import tiny_tokenizer
from envs import ENV_IDS, ToolEnv, ToolEnvConfig, load_tasks
from pacerl.config import ConfigError, RunConfig, load_config, save_config
from trainer.checkpoint import latest_checkpoint, load_checkpoint
from trainer.learner import Learner
from trainer.loop import Run, train_async, train_sync
from trainer.pool import TrajectoryPool

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


def env_factory(config: RunConfig) -> Callable[[], ToolEnv]:
    """A maker of fresh, unwrapped envs of `config.env` (the driver needs `astep` and the tool schemas,
    which Gymnasium's wrappers hide)."""
    spec = config.env
    if spec.id not in ENV_IDS:
        raise ConfigError(f"config: env.id: unknown env {spec.id!r} (known: {', '.join(ENV_IDS)})")
    env_class = gymnasium.spec(spec.id).entry_point
    if not callable(env_class):
        module, _, name = str(env_class).partition(":")
        env_class = getattr(__import__(module, fromlist=[name]), name)
    tasks = load_tasks(spec.tasks) if spec.tasks is not None else None
    options = ToolEnvConfig(
        max_turns=spec.max_turns, max_tool_calls=spec.max_tool_calls, system_prompt=spec.system_prompt
    )
    if spec.id == "pacerl/Search-v0":
        options = replace(options, tool_formats=("hermes",))

    def make() -> ToolEnv:
        env = env_class(tasks=tasks, config=options) if tasks is not None else env_class(config=options)
        if not isinstance(env, ToolEnv):
            raise TypeError(f"{spec.id} made a {type(env).__name__}, not a ToolEnv")
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


def build_run(config: RunConfig, run_dir: Path, model: Any, tokenizer: PreTrainedTokenizerBase) -> Run:
    """Every part of a run, wired as `config` says (nothing runs yet)."""
    engine: Engine
    if config.engine_backend == "sglang":
        options = replace(
            config.sglang,
            weights_dir=config.sglang.weights_dir or str(run_dir / "weights"),
            base_model_dir=config.sglang.base_model_dir or config.model.path,
        )
        engine = SGLangEngine(options)
    else:
        engine = EmbeddedEngine(build_twin(model), tokenizer, config.engine)
    make_env = env_factory(config)
    try:
        num_experts = moe_info(model).num_experts
    except ValueError:
        num_experts = 0
    driver = RolloutDriver(engine, tokenizer, make_env, config.rollout, num_experts=num_experts)
    learner = Learner(model, config.learner, pad_id=int(tokenizer.pad_token_id or 0))
    tasks = make_env().tasks
    return Run(
        learner=learner,
        engine=engine,
        driver=driver,
        tasks=tasks,
        pool=TrajectoryPool(config.filter),
        config=config.loop,
        run_dir=run_dir,
    )


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
    `resume`). Ctrl-C or SIGTERM saves a checkpoint and returns early."""
    run_dir = Path(config.run_dir)
    checkpoint = None
    if resume:  # read and check everything before anything in the run directory is written
        path = latest_checkpoint(run_dir / "checkpoints")
        if path is None:
            raise ConfigError(f"--resume: {run_dir} has no checkpoint to resume from")
        checkpoint = load_checkpoint(path)
    seed_everything(config)
    model, tokenizer = load_policy(config)
    env_factory(config)  # an unknown env or task file fails here, before the run directory is touched
    _prepare_run_dir(run_dir, fresh=not resume)
    save_config(config, run_dir / CONFIG_FILE)
    run = build_run(config, run_dir, model, tokenizer)
    if checkpoint is not None:
        await run.restore(checkpoint)
    loop = train_sync if config.loop.mode == "sync" else train_async
    job = asyncio.ensure_future(loop(run))
    _on_interrupt(run, job)
    summary = await job
    if run.stopping:
        log.warning("stopped at step %d with a checkpoint; continue with --resume %s", run.step, run_dir)
        summary["interrupted"] = True
    return summary


def _on_interrupt(run: Run, job: asyncio.Future[Any]) -> None:
    """The first Ctrl-C (or SIGTERM) ends the run after its current step with a checkpoint; a second
    one cancels at once."""
    loop = asyncio.get_running_loop()

    def interrupt() -> None:
        if run.stopping:
            job.cancel()
        run.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, interrupt)


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
    if resume is not None:
        saved = Path(resume) / CONFIG_FILE
        if not saved.is_file():
            raise ConfigError(f"--resume {resume}: no {CONFIG_FILE} there (is it a run directory?)")
        config = load_config(saved, [*overrides, f"run_dir={resume}"])
    else:
        config = load_config(config_path, overrides)
    summary = asyncio.run(train(config, resume=resume is not None))
    print(summary)
    return 0
