"""Run configuration: one typed tree of the components' own small configs, loaded from TOML or JSON plus
`key=value` overrides, validated at load with a one-line message that names the bad key, and saved
resolved into the run directory. Files, overrides and validation go through `pacerl.settings`, the one
loader of the project's configs.

    config = load_config("my.toml", ["loop.steps=50", "learner.loss.name=grpo"])
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pacerl.agents.engine.embedded import EmbeddedEngineConfig
from pacerl.agents.engine.openai_chat import OpenAIChatOptions
from pacerl.agents.engine.protocol import SamplingParams
from pacerl.agents.engine.sglang import SGLangOptions
from pacerl.agents.evaluation.config import EvalConfig
from pacerl.agents.models import TinyMoEConfig
from pacerl.agents.rollout import RolloutConfig
from pacerl.envs.chat_template import CHATML_TOOLS_TEMPLATE
from pacerl.envs.registry import env_class
from pacerl.sandbox.limits import Limits
from pacerl.settings import ConfigError as ConfigError
from pacerl.settings import apply_overrides, config_to_dict, merge_settings, read_settings, settings_into
from pacerl.trainer.batch_prep import ADVANTAGES
from pacerl.trainer.learner import LearnerConfig
from pacerl.trainer.loop import LoopConfig
from pacerl.trainer.pool import FilterConfig
from pacerl.trainer.trackers import LoggingConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """Which model to train."""

    path: str | None = None
    """A model directory (`pacerl.agents.models.save_model` layout, or any local transformers checkpoint,
    dense or MoE), a `.gguf` file, or a shipped model's short name (`smollm2-135m`: SmolLM2-135M-Instruct,
    installed by `make`); a GGUF is converted once into a cached checkpoint (`pacerl.agents.gguf`). None
    builds the tiny MoE from `tiny`."""
    tiny: TinyMoEConfig = field(default_factory=TinyMoEConfig)
    """Shape of the tiny MoE built when `path` is None."""


_SANDBOX_OPTIONS = {
    "local": ("pacerl.sandbox.local", "LocalOptions"),
    "docker": ("pacerl.sandbox.docker_backend", "DockerOptions"),
    "remote": ("pacerl.sandbox.remote", "RemoteOptions"),
}
"""Each sandbox backend's options dataclass, imported only to check a config's options (the docker
client stays unimported until a config names the docker backend)."""


@dataclass(frozen=True)
class SandboxSpec:
    """Where the env's `python` tool runs its code and under which limits (`pacerl.sandbox`); the
    defaults are the tool's own (`pacerl.envs.tools.python.PYTHON_POLICY`)."""

    backend: Literal["local", "docker", "remote"] = "local"
    """local: a hardened process on this machine; docker: a container per interpreter (needs dockerd);
    remote: a SandboxFusion-compatible server (`options.url`, e.g. `pacerl serve sandbox`)."""
    timeout_s: float = 10.0
    """Wall-clock seconds of one tool call; past it the call ends as a timeout the model reads."""
    cpu_s: float | None = None
    """CPU seconds of one call; None: the timeout's."""
    memory_mb: int = 512
    """Memory of the interpreter and its children, in MiB."""
    max_processes: int = 64
    """Processes and threads the code may have at once."""
    output_cap_bytes: int = 4096
    """Bytes of stdout and of stderr the model reads back; the rest is cut with a marker."""
    options: dict[str, str | int | float | bool] = field(default_factory=dict)
    """The backend's own options, e.g. `image` for docker or `url` for remote (`pacerl.sandbox`'s
    `DockerOptions`, `RemoteOptions`), checked against the backend's at load."""

    def __post_init__(self) -> None:
        if self.backend not in _SANDBOX_OPTIONS:
            raise ValueError(f"env.sandbox.backend must be local, docker or remote, got {self.backend!r}")
        self.limits()  # the sandbox's own range checks, at load
        module, name = _SANDBOX_OPTIONS[self.backend]
        known = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))}
        unknown = sorted(set(self.options) - known)
        if unknown:
            raise ValueError(
                f"env.sandbox.options: the {self.backend} backend has no option {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})"
            )

    def limits(self) -> Limits:
        """The `Limits` of each call."""
        return Limits(
            timeout_s=self.timeout_s,
            cpu_s=self.cpu_s,
            memory_mb=self.memory_mb,
            max_processes=self.max_processes,
            output_cap_bytes=self.output_cap_bytes,
        )


@dataclass(frozen=True)
class EnvSpec:
    """The environment episodes are played in."""

    id: str = "pacerl/CodeMath-v0"
    """Any registered `ToolEnv` id: a shipped one (`pacerl.envs.ENV_IDS`), or `module:Name-v0` for an env a
    user's module registers when imported (Gymnasium's form; `pacerl.envs.registry.env_class`)."""
    tasks: str | None = None
    """Training tasks: a shipped set name or a .jsonl/.parquet path; None: the env's default."""
    system_prompt: str | None = ""
    """The system message: "" none (the tiny model learns the format by SFT), None the env's own."""
    max_turns: int = 3
    """Assistant messages per episode."""
    max_tool_calls: int = 2
    """Tool calls per episode."""
    retriever_url: str | None = None
    """The search tool's Search-R1 `/retrieve` server; None: an env that needs one starts its own for
    the run (the Search env serves BM25 over the shipped corpus in process)."""
    sandbox: SandboxSpec = field(default_factory=SandboxSpec)
    """The sandbox of the env's `python` tool: backend and limits."""

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tool_calls < 0:
            raise ValueError("max_turns must be >= 1 and max_tool_calls >= 0")


@dataclass(frozen=True)
class WarmStartSpec:
    """Supervised warm start on generated demonstrations of the env (`pacerl.trainer.sft`), so that RL starts
    from a policy that knows the tool format and sometimes succeeds (docs/learnability.md)."""

    when: Literal["fresh", "always", "never"] = "fresh"
    """fresh: only for a model built from `model.tiny` (a loaded checkpoint is taken as warm already);
    always; never."""
    steps: int | None = None
    """Optimizer steps; None: the env's default for the style (`ToolEnv.warm_start_steps`: CodeMath's
    clean+teacher 400, 200 of each; teacher 300, its behaviour gap in place by then; clean 75,
    docs/learnability.md's skill gap; Search's clean 300, copying out of passages is learnt late)."""
    style: str = "auto"
    """Demonstration style, one the env writes (`ToolEnv.warm_start_steps`; the shipped envs: clean tool
    use, or CodeMath's teacher, whose behaviour gap RL closes within minutes on this CPU); auto: the
    env's first. An env that writes none trains without a warm start."""
    batch_size: int = 64
    """Demonstrations per step."""
    lr: float = 2e-3
    """Peak learning rate, after a linear warm-up over `warmup_steps`."""
    warmup_steps: int = 50
    """Steps of linear warm-up to `lr` (0: none)."""
    tasks: str | None = None
    """Tasks to demonstrate; None: the env's training tasks."""

    def __post_init__(self) -> None:
        if self.when not in ("fresh", "always", "never") or not self.style:
            raise ValueError("sft.when must be fresh, always or never and sft.style auto or a style name")
        if (self.steps is not None and self.steps < 0) or self.batch_size < 1 or not self.lr > 0:
            raise ValueError("sft.steps must be >= 0, sft.batch_size >= 1 and sft.lr > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"sft.warmup_steps must be >= 0, got {self.warmup_steps}")

    def resolved(self, env_id: str) -> tuple[str, int]:
        """(style, steps) for a warm start on `env_id`, with `auto` and None filled in from the env
        (`ToolEnv.warm_start_steps`); ("", 0) for an env that writes no demonstrations (with `auto`).
        ValueError: a style the env does not write, or explicit steps for an env that writes none."""
        styles = env_class(env_id).warm_start_steps
        if not styles:
            if self.style != "auto" or self.steps:
                raise ValueError(
                    f"sft: {env_id} writes no demonstrations, so it cannot warm-start with style "
                    f"{self.style!r} and steps {self.steps}: set sft.when=never or give a model.path"
                )
            return "", 0
        style = next(iter(styles)) if self.style == "auto" else self.style
        if style not in styles:
            raise ValueError(f"sft.style: {env_id} writes {', '.join(styles)} demonstrations, not {style!r}")
        return style, styles[style] if self.steps is None else self.steps


def _greedy_eval() -> EvalConfig:
    return EvalConfig(samples=1, temperature=0.0, max_tasks=200)


@dataclass(frozen=True)
class EvalSpec:
    """Evaluation during training: the model is scored on held-out tasks by a second engine holding a
    snapshot of the weights, in the background, labelled with the policy version it evaluated."""

    every: int = 10
    """Steps between evaluations (0: none during training)."""
    at_start: bool = True
    """Evaluate before the first step (after the warm start)."""
    at_end: bool = True
    """Evaluate after the last step (awaited: the run's final figure)."""
    tasks: str | None = None
    """Held-out tasks; None: the env's shipped validation set."""
    extra_tasks: dict[str, str] | None = None
    """Further held-out sets evaluated beside `tasks`, by name (a shipped set name or a task file), each
    reported on its own as `eval/<name>/*`; None: the env's (`ToolEnv.extra_validation_tasks`, e.g.
    CodeMath's held-out question forms as `heldout`); {} none."""
    settings: EvalConfig = field(default_factory=_greedy_eval)
    """How episodes are sampled and scored (default: greedy, one sample, the first 200 tasks)."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"evaluation.every must be >= 0, got {self.every}")


@dataclass(frozen=True)
class RaySpec:
    """Where the parts go with `runtime = "ray"` (docs/ray.md): engine replicas, environment workers and
    the trainer run as Ray actors; the rollout driver, the pool and its filter stay in the driver."""

    address: str | None = None
    """The cluster to join (`auto`, `host:6379`, `ray://host:10001`); None starts a local one for the
    run (or uses the cluster this process has already joined)."""
    num_cpus: int | None = None
    """CPUs of the local cluster started when `address` is None; None: all of this machine's."""
    num_engine_replicas: int = 2
    """Engine actors generating rollouts: embedded engines, or (engine_backend=sglang) clients of the
    servers in `sglang_urls`, one each."""
    num_env_workers: int = 1
    """Actors hosting the episodes' environments and their sandboxes; 0 keeps them in the driver."""
    engine_cpus: float = 0.5
    """CPUs Ray reserves for each engine replica; its torch threads are as many (at least one)."""
    engine_gpus: float = 0.0
    """GPUs reserved for each engine replica; above 0 an embedded engine runs on its GPU."""
    env_cpus: float = 0.25
    """CPUs Ray reserves for each environment worker."""
    trainer_cpus: float = 0.5
    """CPUs Ray reserves for the trainer actor; its torch threads are as many (at least one)."""
    trainer_gpus: float = 0.0
    """GPUs reserved for the trainer actor (the source of an NCCL broadcast)."""
    max_restarts: int = 3
    """Times each engine replica and environment worker is replaced by a new actor after it dies (a
    crash, `ray.kill`, a lost node) before the run gives up on it."""
    restart_timeout_s: float = 300.0
    """Seconds the actors may take to start, and an unreachable one to answer again before it is
    replaced."""
    sglang_urls: tuple[str, ...] = ()
    """engine_backend=sglang: one server per replica (empty: `sglang.url`, one replica)."""
    weight_sync: Literal["object_store", "broadcast"] = "object_store"
    """How published weights reach the replicas: one copy put in Ray's object store that every replica
    reads, or a torch.distributed broadcast from the trainer actor (NCCL between GPUs)."""
    broadcast_backend: Literal["nccl", "gloo"] = "nccl"
    """The torch.distributed backend of `weight_sync = "broadcast"`: nccl between GPUs, gloo on CPUs."""

    def __post_init__(self) -> None:
        if self.num_engine_replicas < 1 or self.num_env_workers < 0 or self.max_restarts < 0:
            raise ValueError("ray.num_engine_replicas >= 1, num_env_workers >= 0, max_restarts >= 0")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"ray.num_cpus must be >= 1 or None, got {self.num_cpus}")
        resources = (self.engine_cpus, self.engine_gpus, self.env_cpus, self.trainer_cpus, self.trainer_gpus)
        if min(resources) < 0 or not self.restart_timeout_s > 0:
            raise ValueError("ray: CPUs and GPUs must be >= 0 and restart_timeout_s > 0")
        if self.weight_sync not in ("object_store", "broadcast"):
            raise ValueError(f"ray.weight_sync must be object_store or broadcast, got {self.weight_sync!r}")
        if self.broadcast_backend not in ("nccl", "gloo"):
            raise ValueError(f"ray.broadcast_backend must be nccl or gloo, got {self.broadcast_backend!r}")
        nccl = self.weight_sync == "broadcast" and self.broadcast_backend == "nccl"
        if nccl and not (self.engine_gpus > 0 and self.trainer_gpus > 0):
            raise ValueError("ray.broadcast_backend=nccl needs ray.engine_gpus and ray.trainer_gpus > 0")


EMULATION_PRESETS = ("areal", "verl", "pacerl-cpu")
"""pacerl.lab.presets.PRESETS' names (a test keeps them equal): the run config imports no lab module."""


@dataclass(frozen=True)
class EmulationSpec:
    """Emulated-cluster training (`pacerl.lab.emulated`, docs/simulation.md): the real model, env and
    learner under the clock of `pacerl simulate`, which decides when rollouts start, which version is
    live for each generated token, when steps end and how long groups wait, as on the preset's GPUs."""

    clock: Literal["real", "emulated"] = "real"
    """real: this machine's time decides (the plain loops); emulated: the simulator's clock does."""
    preset: str = "areal"
    """The cost models and cluster of the clock: a `pacerl simulate --preset` name (areal, verl,
    pacerl-cpu)."""
    inference_gpus: int | None = None
    """GPUs running inference engines on the emulated cluster; None: the preset's. >= 1."""
    trainer_gpus: int | None = None
    """GPUs training on the emulated cluster; None: the preset's. >= 1."""
    token_scale: int = 1
    """Simulated tokens each real token costs in the decode, prefill, KV and training models (a tiny
    model's short turns stretched to a preset's lengths; the records keep the real tokens). >= 1."""
    max_gpu_hours: float | None = None
    """Stop after the step at which the emulated cluster (inference plus trainer GPUs) has spent this many
    simulated GPU-hours, so that arms on different loops compare at equal cost; None: `loop.steps` (and
    `loop.max_wall_s`) alone decide. > 0."""

    def __post_init__(self) -> None:
        if self.clock not in ("real", "emulated"):
            raise ValueError(f"emulation.clock must be real or emulated, got {self.clock!r}")
        if self.preset not in EMULATION_PRESETS:
            raise ValueError(
                f"emulation.preset must be one of {', '.join(EMULATION_PRESETS)}, got {self.preset!r}"
            )
        for name in ("inference_gpus", "trainer_gpus"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"emulation.{name} must be an integer >= 1 or None, got {value!r}")
        if (
            isinstance(self.token_scale, bool)
            or not isinstance(self.token_scale, int)
            or self.token_scale < 1
        ):
            raise ValueError(f"emulation.token_scale must be an integer >= 1, got {self.token_scale!r}")
        if self.max_gpu_hours is not None and not self.max_gpu_hours > 0:
            raise ValueError(f"emulation.max_gpu_hours must be > 0 or None, got {self.max_gpu_hours!r}")


def _default_rollout() -> RolloutConfig:
    # docs/learnability.md: T = 0.7, short turns; tool schemas are learned by SFT, not read from the prompt.
    sampling = SamplingParams(max_new_tokens=40, temperature=0.7, stop_strings=("</tool_call>",))
    return RolloutConfig(group_size=8, sampling=sampling, max_total_tokens=256, tool_schemas_in_prompt=False)


def _default_learner() -> LearnerConfig:
    return LearnerConfig(temperature=0.7)


@dataclass(frozen=True)
class RunConfig:
    """Everything a training run needs; each component receives only its own part."""

    run_dir: str = "runs/pacerl"
    """Where the config, metrics, TensorBoard events, checkpoints and plots go."""
    threads: int = 2
    """torch threads (the engine and the learner share them)."""
    seed: int = 0
    """Seed of torch, numpy and python's RNGs at the start of the run, and with their own seeds of the
    engine's samplers (`engine.seed`) and the task order (`loop.seed`): runs that differ only in `seed`
    are independent replicates (`pacerl.assembly.replicate_seed`)."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """The model."""
    env: EnvSpec = field(default_factory=EnvSpec)
    """The environment and its tasks."""
    sft: WarmStartSpec = field(default_factory=WarmStartSpec)
    """The supervised warm start before RL."""
    rollout: RolloutConfig = field(default_factory=_default_rollout)
    """How episodes are sampled (group size, sampling, context budget)."""
    engine_backend: Literal["embedded", "sglang", "openai"] = "embedded"
    """Where rollouts are generated: the in-process engine, an SGLang server (see `sglang`), or (for
    `pacerl eval` only) any OpenAI-compatible chat-completions server (see `openai`)."""
    engine: EmbeddedEngineConfig = field(default_factory=lambda: EmbeddedEngineConfig(max_batch=256))
    """The embedded inference engine (on CPU, one wide batch beats many narrow steps)."""
    sglang: SGLangOptions = field(default_factory=SGLangOptions)
    """The SGLang server and weight publication to it; `weights_dir` defaults to `run_dir/weights` and
    `base_model_dir` to `model.path` (the server must read both under the same paths)."""
    openai: OpenAIChatOptions = field(default_factory=OpenAIChatOptions)
    """The served model of `engine_backend = "openai"`: base URL, model name, the environment variable
    holding the API key, timeouts, whether the env's tools are sent (docs/serving.md)."""
    learner: LearnerConfig = field(default_factory=_default_learner)
    """Loss, advantages, optimizer, R3."""
    filter: FilterConfig = field(default_factory=FilterConfig)
    """The pool's staleness filter and rollout admission (PACE's target: one batch waiting plus half)."""
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(steps=40, batch_groups=16))
    """Sync or async, steps, batch size, publication interval, checkpoints."""
    evaluation: EvalSpec = field(default_factory=EvalSpec)
    """Evaluation on held-out tasks during and after training."""
    runtime: Literal["local", "ray"] = "local"
    """Where the parts run: all in this process, or as Ray actors (see `ray`); the same code either way."""
    ray: RaySpec = field(default_factory=RaySpec)
    """The Ray cluster and the actors of `runtime = "ray"`."""
    emulation: EmulationSpec = field(default_factory=EmulationSpec)
    """Train under the clock of a simulated GPU cluster (`emulation.clock = "emulated"`)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Where each step's metrics go besides metrics.jsonl: TensorBoard, W&B, MLflow (`logging.trackers`)."""

    def __post_init__(self) -> None:
        if self.engine_backend not in ("embedded", "sglang", "openai"):
            raise ValueError(
                f"engine_backend must be embedded, sglang or openai, got {self.engine_backend!r}"
            )
        if self.engine_backend == "sglang" and self.model.path is None:
            raise ValueError("engine_backend=sglang needs model.path: the server loads the same checkpoint")
        chosen = self.filter.filter
        lag = self.loop.sync_interval - 1 if self.loop.mode == "async" else 0
        problem = chosen.check(self.filter.settings, self.loop.batch_groups, lag) if chosen.check else None
        if problem:
            raise ValueError(problem)
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size={self.rollout.group_size}: every advantage estimator "
                f"(learner.advantage: {', '.join(ADVANTAGES)}) measures an episode against its group's mean, "
                "so a group of one has advantage 0 and no step would train; use rollout.group_size >= 2"
            )
        if self.runtime not in ("local", "ray"):
            raise ValueError(f"runtime must be local or ray, got {self.runtime!r}")
        if self.runtime == "ray" and self.engine_backend == "sglang":
            servers = len(self.ray.sglang_urls) or 1
            if servers != self.ray.num_engine_replicas:
                raise ValueError(
                    f"ray.num_engine_replicas ({self.ray.num_engine_replicas}) must equal the SGLang servers "
                    f"({servers}: ray.sglang_urls, or sglang.url alone)"
                )
            if self.ray.weight_sync == "broadcast":
                raise ValueError("ray.weight_sync=broadcast is for embedded engines; SGLang loads from disk")
        if self.emulation.clock == "emulated":
            refused = {
                "runtime=ray": self.runtime == "ray",
                f"engine_backend={self.engine_backend}": self.engine_backend != "embedded",
                "engine.interrupt=continue": self.engine.interrupt == "continue",
                f"loop.lag={self.loop.lag}": self.loop.lag > 0,
            }
            bad = [name for name, hit in refused.items() if hit]
            if bad:
                raise ValueError(
                    f"emulation.clock=emulated cannot run with {', '.join(bad)}: the emulated clock drives "
                    "the embedded engine in this process and regenerates an interrupted turn's rest under "
                    "the new weights (reprefill); use runtime=local, engine_backend=embedded, "
                    "engine.interrupt=reprefill, and no loop.lag (a fixed lag needs no cluster's clock)"
                )
        ranks = self.learner.world_size
        if ranks > 1 and self.runtime == "ray" and self.ray.weight_sync == "broadcast":
            raise ValueError(
                f"ray.weight_sync=broadcast cannot serve a learner of {ranks} ranks: its ranks own "
                "torch.distributed's default group, which the broadcast group would need; use "
                "ray.weight_sync=object_store"
            )
        sampled = self.rollout.sampling.temperature
        if sampled <= 0:
            raise ValueError("rollout.sampling.temperature must be > 0 (RL learns from sampled log-probs)")
        top_p, top_k = self.rollout.sampling.top_p, self.rollout.sampling.top_k
        if top_p < 1 or top_k > 0:
            # The learner scores the whole tempered softmax; a truncated draw's log-probs (the embedded
            # engine's) or untruncated ones (SGLang's) would then not be the same distribution's.
            raise ValueError(
                f"rollout.sampling.top_p={top_p} and top_k={top_k} truncate the distribution the tokens are "
                "drawn from, but the learner scores the full softmax, so the ratio π/μ would compare two "
                "different distributions: train with top_p=1 and top_k=0 (truncated sampling is for eval)"
            )
        if abs(self.learner.temperature - sampled) > 1e-9:
            raise ValueError(
                f"learner.temperature ({self.learner.temperature}) must equal rollout.sampling.temperature "
                f"({sampled}): log-probs are compared at the temperature that was sampled"
            )


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The config in `path` (TOML or JSON; None: the defaults) with `key=value` overrides applied
    (dotted keys, values parsed as JSON when they parse, else kept as strings), and for a real
    checkpoint the budgets and prompt it left unset taken from the model (`model_defaults`); a
    setting that looks wrong for the model is logged as a warning (`model_warnings`). ConfigError on
    any problem, naming the key."""
    given = apply_overrides(read_settings(Path(path)) if path is not None else {}, overrides)
    config = config_from_dict(merge_settings(model_defaults(given), given))
    for warning in model_warnings(config):
        log.warning("%s", warning)
    return config


REAL_MODEL_NEW_TOKENS = 1024
"""Tokens per assistant turn a real checkpoint gets unless the config says otherwise: room for some
reasoning, one tool call and, on the last turn, the answer (ReTool's and Search-R1's turns fit)."""
REAL_MODEL_TOTAL_TOKENS = 8192
"""The most tokens a whole episode gets by default (the model's context when smaller): several turns of
`REAL_MODEL_NEW_TOKENS` with their tool responses, while a group of such sequences still fits one
learner micro-batch and the engine's KV cache on one GPU; longer runs set `max_total_tokens`."""
MIN_TURN_TOKENS = 64
"""Fewer new tokens per turn than this cannot hold one tool call and an answer."""
SHIPPED_CONTEXT = {"smollm2-135m": 8192}
"""Context length of each shipped model's short name (`pacerl.agents.gguf.SHIPPED`), known without
converting its GGUF."""
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


@dataclass(frozen=True)
class ModelFacts:
    """What the defaults of a real checkpoint follow, read from its files without loading weights."""

    path: str
    """The model as the config names it (`model.path`)."""
    context: int | None
    """Tokens of context it was trained on (its config.json), None where that cannot be read (a hub
    name, a model not on this machine, a .gguf file)."""


def model_facts(path: str | None) -> ModelFacts | None:
    """The facts of `model.path`; None for the tiny model: `path` None, or a checkpoint whose tokenizer
    carries pacerl's own chat template (`CHATML_TOOLS_TEMPLATE`: a tiny model pacerl trained and saved,
    which learned its tools by SFT and keeps the tiny defaults)."""
    if path is None:
        return None
    if path in SHIPPED_CONTEXT:
        return ModelFacts(path, SHIPPED_CONTEXT[path])
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        return ModelFacts(path, None)
    if _saved_template(directory) == CHATML_TOOLS_TEMPLATE.strip():
        return None
    try:
        hf = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return ModelFacts(path, None)  # loading the model will say what is wrong with it
    sections = [hf, hf.get("text_config") or {}] if isinstance(hf, dict) else []
    lengths = [s[key] for s in sections for key in _CONTEXT_KEYS if isinstance(s.get(key), int)]
    return ModelFacts(path, lengths[0] if lengths else None)


def _saved_template(directory: Path) -> str | None:
    """The chat template a checkpoint's tokenizer files hold (stripped), if any."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8").strip()
    try:
        settings = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    template = settings.get("chat_template") if isinstance(settings, dict) else None
    return template.strip() if isinstance(template, str) else None


def model_defaults(given: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a real checkpoint (`given`'s `model.path`, `model_facts`) gets where the user set
    none: the tiny model's 40 new tokens and 256 in all would cut a real model off before its first tool
    call, so each turn gets `REAL_MODEL_NEW_TOKENS` (at most half the episode) and the episode its
    context up to `REAL_MODEL_TOTAL_TOKENS`, in training and evaluation alike; the env's tool schemas and
    its own system prompt go into the prompt (the tiny model learns both by SFT instead). {} for the tiny
    model: its defaults stay as they are."""
    model = given.get("model")
    path = model.get("path") if isinstance(model, Mapping) else None
    facts = model_facts(path) if isinstance(path, str) else None
    if facts is None:
        return {}
    total = min(facts.context or REAL_MODEL_TOTAL_TOKENS, REAL_MODEL_TOTAL_TOKENS)
    new = min(REAL_MODEL_NEW_TOKENS, total // 2)
    budgets = {"max_new_tokens": new, "max_total_tokens": total, "tool_schemas_in_prompt": True}
    rollout = {"max_total_tokens": total, "tool_schemas_in_prompt": True, "sampling": {"max_new_tokens": new}}
    return {"env": {"system_prompt": None}, "rollout": rollout, "evaluation": {"settings": budgets}}


def model_warnings(config: RunConfig) -> list[str]:
    """One line for each setting of `config` that looks wrong for its model (none for the tiny model):
    an episode budget above the model's context, a turn too short for a tool call and an answer, an env
    whose tools the model is never shown or may not call."""
    facts = model_facts(config.model.path)
    if facts is None:
        return []
    try:
        tools = env_class(config.env.id).tool_names
    except ValueError:  # refused where the env is built, under the name of its flag (--env, env.id)
        tools = ()
    settings = config.evaluation.settings
    budgets = [
        ("rollout", config.rollout.max_total_tokens, config.rollout.sampling.max_new_tokens),
        ("evaluation.settings", settings.max_total_tokens, settings.max_new_tokens),
    ]
    schemas = [
        ("rollout", config.rollout.tool_schemas_in_prompt),
        ("evaluation.settings", settings.tool_schemas_in_prompt),
    ]
    found = []
    for section, total, new in budgets:
        new_key = "sampling.max_new_tokens" if section == "rollout" else "max_new_tokens"
        if facts.context is not None and total > facts.context:
            found.append(
                f"{section}.max_total_tokens={total} is above the {facts.context}-token context of "
                f"{facts.path}: the model has not seen positions that far"
            )
        if tools and new < MIN_TURN_TOKENS:
            found.append(
                f"{section}.{new_key}={new} cannot hold one tool call plus an answer "
                f"({MIN_TURN_TOKENS} tokens at least) for {facts.path} on {config.env.id}"
            )
    if tools and config.env.system_prompt == "":
        for section, shown in schemas:
            if not shown:
                found.append(
                    f'{section}.tool_schemas_in_prompt=false with env.system_prompt="": {facts.path} '
                    f"is never told of {config.env.id}'s tools ({', '.join(tools)})"
                )
    if tools and config.env.max_tool_calls == 0:
        found.append(f"env.max_tool_calls=0 turns off {config.env.id}'s tools ({', '.join(tools)})")
    return found


def config_from_dict(data: Mapping[str, Any]) -> RunConfig:
    """Validate a plain mapping into a RunConfig: what it leaves out keeps the default config's value
    (a section given in part keeps its other defaults); unknown keys and wrong types are errors."""
    try:
        return settings_into(RunConfig(), data)
    except ConfigError as error:
        raise ConfigError(f"config: {error}") from None


def save_config(config: RunConfig, path: Path) -> None:
    """The resolved config as JSON (what `load_config` reads back to the same RunConfig)."""
    path.write_text(config_json(config), encoding="utf-8")


def config_json(config: RunConfig) -> str:
    """The resolved config as the JSON text a run saves (`save_config`) and `--print-config` prints."""
    return json.dumps(config_to_dict(config), indent=2) + "\n"
