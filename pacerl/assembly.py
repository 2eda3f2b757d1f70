"""A run's parts built from its config: the env maker, the policy and its tokenizer, the warm start,
the engine, learner, driver and pool wired into a `pacerl.trainer.loop.Run`, and the background evaluator.
`pacerl train` (and `pacerl sft`, `pacerl eval`) call these; nothing here parses arguments."""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.engine.protocol import Engine
from pacerl.agents.engine.sglang import SGLangEngine
from pacerl.agents.models import build_tiny_moe, layout_of, load_model, moe_info
from pacerl.agents.rollout import EpisodeEnv, RolloutDriver
from pacerl.agents.tokenizer import tiny_tokenizer, with_chat_template
from pacerl.config import ConfigError, RunConfig
from pacerl.display import ProgressDisplay
from pacerl.envs import Task, ToolEnv, load_tasks
from pacerl.envs.registry import env_class, registered_kwargs
from pacerl.envs.tasks import hold_out
from pacerl.envs.tools.core import SANDBOX_POLICIES, SandboxPolicy
from pacerl.parallel import start_learner
from pacerl.settings import config_to_dict
from pacerl.trainer.distributed import LearnerGroup
from pacerl.trainer.evaluator import BackgroundEvaluator
from pacerl.trainer.learner import Learner, LearnerLike
from pacerl.trainer.loop import Run
from pacerl.trainer.pool import TrajectoryPool
from pacerl.trainer.sft import SFTConfig, demonstrations, sft
from pacerl.trainer.trackers import open_metrics

log = logging.getLogger(__name__)


def env_factory(config: RunConfig, tasks: Sequence[Task] | None = None) -> Callable[[], ToolEnv]:
    """A maker of fresh, unwrapped envs of `config.env` (the driver needs `astep` and the tool schemas,
    which Gymnasium's wrappers hide), built as `gymnasium.make` would (with the id's registered
    kwargs) but with the run's episode limits, prompt, tasks (`tasks` when given) and tool settings."""
    spec = config.env
    try:
        cls = env_class(spec.id)
        kwargs = registered_kwargs(spec.id)
    except ValueError as error:
        raise ConfigError(f"config: env.id: {error}") from None
    if tasks is not None:
        kwargs["tasks"] = list(tasks)
    elif spec.tasks is not None:
        kwargs["tasks"] = load_tasks(spec.tasks)
    takes_tasks = inspect.signature(cls).parameters.get("tasks")
    no_default = takes_tasks is not None and takes_tasks.default is inspect.Parameter.empty
    if no_default and "tasks" not in kwargs:
        raise ConfigError(
            f"config: env.tasks: {spec.id} has no default tasks: name a task file or shipped set"
        )
    options = replace(
        kwargs.pop("config", None) or cls.default_config(),
        max_turns=spec.max_turns,
        max_tool_calls=spec.max_tool_calls,
        system_prompt=spec.system_prompt,
    )
    options = replace(options, settings={**options.settings, **sandbox_settings(config)})
    if spec.retriever_url is not None:
        options = replace(options, settings={**options.settings, "retriever_url": spec.retriever_url})

    env_id = spec.id  # the maker holds nothing of pacerl.config: Ray env workers unpickle it without torch

    def make() -> ToolEnv:
        env = cast(Any, cls)(**kwargs, config=options)
        if not isinstance(env, ToolEnv):
            raise TypeError(f"{env_id} made a {type(env).__name__}, not a ToolEnv")
        return env

    return make


def sandbox_settings(config: RunConfig) -> dict[str, Any]:
    """The env settings that put the `python` tool in the sandbox `config.env.sandbox` names."""
    spec = config.env.sandbox
    policy = SandboxPolicy(backend=spec.backend, limits=spec.limits(), options=dict(spec.options))
    return {SANDBOX_POLICIES: {"python": policy}}


TOKENIZER_DIR = "tokenizer"
"""Where a run built from `model.tiny` keeps the tokenizer it was trained with (in its run directory)."""


def load_policy(config: RunConfig, saved: Path | None = None) -> tuple[Any, PreTrainedTokenizerBase]:
    """The model to train and its tokenizer: built from `model.tiny` (with the tokenizer saved in
    `saved` when it holds one: a resumed run keeps the tokens its weights were trained on, even after
    the tiny tokenizer's corpus changed in a newer pacerl), or loaded from `model.path` with the
    checkpoint's own tokenizer and chat template (pacerl's template only when it has none)."""
    if config.model.path is None:
        if saved is not None and (saved / "tokenizer.json").is_file():
            tokenizer = with_chat_template(AutoTokenizer.from_pretrained(saved))
        else:
            tokenizer = tiny_tokenizer()
        return build_tiny_moe(config.model.tiny, tokenizer), tokenizer
    try:
        model, loaded = load_model(config.model.path)
    except (FileNotFoundError, ValueError, OSError) as error:
        raise ConfigError(f"config: model.path: {error}") from None
    return model, with_chat_template(loaded)


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
            from pacerl.ray_runtime.runtime import RayRuntime, RaySettings  # Ray is an optional extra
        except ImportError as error:
            raise ConfigError(f"runtime=ray needs Ray ({error}): pip install 'pacerl[ray]'") from None
        runtime = RayRuntime(RaySettings.of(config), run_dir, model, tokenizer, make_env)
        engine, learner, make_episode = runtime.engine, runtime.learner, runtime.make_env
    elif config.engine_backend == "sglang":
        options = replace(
            config.sglang,
            weights_dir=config.sglang.weights_dir or str(run_dir / "weights"),
            base_model_dir=config.sglang.base_model_dir or config.model.path,
        )
        engine = SGLangEngine(options, layout=layout_of(type(model), model.config))
    else:
        engine_seed = replicate_seed(config.engine.seed, config.seed)
        engine = EmbeddedEngine(build_twin(model), tokenizer, replace(config.engine, seed=engine_seed))
    group = None
    if runtime is None and config.learner.parallel == "fsdp":
        group = start_learner(
            model, config.learner, pad_id=int(tokenizer.pad_token_id or 0), threads=config.threads
        )
        learner = group
    elif runtime is None:
        learner = Learner(model, config.learner, pad_id=int(tokenizer.pad_token_id or 0))
    driver = RolloutDriver(engine, tokenizer, make_episode, config.rollout, num_experts=num_experts(model))
    metrics = open_metrics(config.logging, run_dir, config_to_dict(config))
    run = Run(
        learner=learner,
        engine=engine,
        driver=driver,
        tasks=tasks,
        pool=TrajectoryPool(config.filter),
        config=replace(config.loop, seed=replicate_seed(config.loop.seed, config.seed)),
        run_dir=run_dir,
        metrics=metrics,
    )
    if runtime is not None:
        runtime.attach(run)
    if group is not None:
        run.on_release.append(functools.partial(_release_ranks, group, model))
    return run


async def _release_ranks(group: LearnerGroup, model: Any) -> None:
    """Copy the trained weights into `model` (what the run saves), then stop the learner's ranks."""
    try:
        if not group.broken:  # else the run ends on the error that broke it, with its checkpoint
            model.load_state_dict(await asyncio.to_thread(group.weights))
    finally:
        await asyncio.to_thread(group.close)


def replicate_seed(own: int, run_seed: int) -> int:
    """The seed a component (`engine.seed`: the samplers; `loop.seed`: the task order) runs with under the
    run's `seed`: its own at run seed 0, another one for every other run seed, so that runs differing
    only in `seed` are independent replicates (a warm-started model has no random init for the torch
    seed to change, so without this they would be the same run)."""
    return own + 1_000_003 * run_seed


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
    losses: list[float] = []
    stages = warm_start_stages(config.env.id, style, steps)
    for index, (stage, stage_steps) in enumerate(stages):
        demos = demonstrations(
            config.env.id,
            tasks,
            seed=config.seed,
            style=stage,
            system_prompt=config.env.system_prompt,
            tool_schemas=config.rollout.tool_schemas_in_prompt,
            tokenizer=tokenizer,
        )
        sft_config = SFTConfig(
            lr=spec.lr,
            warmup_steps=spec.warmup_steps,
            steps=stage_steps,
            batch_size=spec.batch_size,
            seed=config.seed,
        )
        label = f"sft ({stage})" if len(stages) == 1 else f"sft ({stage}, stage {index + 1}/{len(stages)})"
        with ProgressDisplay(label, stage_steps, 0) as display:

            def on_step(step: int, loss: float) -> bool:
                display.show(step + 1, f"loss {loss:.3f}")
                return stop is not None and stop.is_set()

            losses += sft(model, demos, sft_config, on_step=on_step)
        if stop is not None and stop.is_set():
            raise WarmStartInterruptedError(
                f"interrupted during the SFT warm start at step {len(losses)} of {steps}"
            )
    return {"sft/first_loss": losses[0], "sft/last_loss": losses[-1], "sft/steps": float(len(losses))}


def warm_start_stages(env_id: str, style: str, steps: int) -> list[tuple[str, int]]:
    """(demonstration style, steps) of each stage of a warm start in `style`: one stage, unless the env
    makes `style` a curriculum (`ToolEnv.warm_start_stages`), whose stages share `steps` evenly (the
    first ones take the remainder; a stage left without steps is skipped)."""
    cls = env_class(env_id)
    curriculum = tuple(cls.warm_start_stages.get(style, (style,)))
    for stage in curriculum if style in cls.warm_start_stages else ():
        if stage not in cls.warm_start_steps or stage in cls.warm_start_stages:
            raise ValueError(f"{env_id}: the curriculum {style!r} names {stage!r}, not a demonstration style")
    share, extra = divmod(steps, len(curriculum))
    stages = [(stage, share + (index < extra)) for index, stage in enumerate(curriculum)]
    return [(stage, count) for stage, count in stages if count > 0]


def seed_everything(config: RunConfig) -> None:
    """Threads and seeds of torch, numpy and python."""
    torch.set_num_threads(config.threads)
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)


def build_twin(model: Any) -> Any:
    """The engine's own copy of the trained model: generation goes on while the learner updates its
    weights, so the two cannot share parameters; weights reach the engine only by publication. Nor a
    config: the engine switches its model's attention function through the config while it steps."""
    twin = type(model)(copy.deepcopy(model.config))
    twin.load_state_dict(model.state_dict())
    return twin.eval()


def num_experts(model: Any) -> int:
    """Experts per MoE layer, 0 for a dense model (whose engine records no routes)."""
    try:
        return moe_info(model).num_experts
    except ValueError:
        return 0


def held_out_of_training(config: RunConfig, tasks: Sequence[Task]) -> tuple[list[Task], list[Task] | None]:
    """(the tasks to train on, the tasks to evaluate on when the run evaluates and neither the config
    nor the env names a validation set: a slice of the training tasks held out of training, chosen by
    the run's seed (`pacerl.envs.tasks.hold_out`), said in the log; else None)."""
    evaluates = config.evaluation.every or config.evaluation.at_start or config.evaluation.at_end
    cls = env_class(config.env.id)
    shipped = cls.validation_tasks_for(config.env.tasks)
    if not evaluates or config.evaluation.tasks is not None or shipped is not None:
        return list(tasks), None
    try:
        kept, held = hold_out(tasks, config.seed)
    except ValueError as error:
        raise ConfigError(
            f"config: evaluation.tasks: {config.env.id} ships no validation set and {error}: name a "
            "task file, or turn evaluation off (evaluation.every=0 evaluation.at_start=false "
            "evaluation.at_end=false)"
        ) from None
    log.warning(
        "%s ships no validation set: evaluating on %d of its %d training tasks, held out of training "
        "(seed %d; evaluation.tasks names a set of your own)",
        config.env.id, len(held), len(tasks), config.seed,
    )  # fmt: skip
    return kept, held


def background_evaluator(
    config: RunConfig,
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    version: int,
    make_env: Callable[[], ToolEnv],
    *,
    held_out: Sequence[Task] | None = None,
) -> BackgroundEvaluator:
    """The run's evaluator: its own engine on a twin of `model` at `version`, the held-out tasks
    (`evaluation.tasks`, else the env's shipped validation set, else `held_out`: the training tasks
    `held_out_of_training` kept back) and the further named sets (`evaluation.extra_tasks`, else the
    env's `extra_validation_tasks`)."""
    cls = env_class(config.env.id)
    source = config.evaluation.tasks or cls.validation_tasks_for(config.env.tasks)
    named = config.evaluation.extra_tasks
    extra = cls.extra_validation_tasks if named is None else named
    if source is None and held_out is None:
        raise ConfigError(
            f"config: evaluation.tasks: {config.env.id} ships no validation set: name a task file, or "
            "turn evaluation off (evaluation.every=0 evaluation.at_start=false evaluation.at_end=false)"
        )
    return BackgroundEvaluator(
        EmbeddedEngine(build_twin(model), tokenizer, version=version),
        tokenizer,
        make_env,
        load_tasks(source) if source is not None else list(held_out or ()),
        config.evaluation.settings,
        every=config.evaluation.every,
        num_experts=num_experts(model),
        extra_tasks={name: load_tasks(path) for name, path in extra.items()},
    )
