"""`ToolEnv`: a real `gymnasium.Env` whose action is the assistant's message and whose observation is
the new chat messages; subclasses say which tools exist, how a task is posed, and how it is scored.

The rollout side awaits `astep` so that hundreds of episodes step concurrently on one loop; `step` is
its sync face. Model output never raises here: malformed calls, unknown tools, bad arguments, tool
timeouts and dead services all become tool messages the model reads, flagged in `info`.

What training and evaluation ask of an env class, every part optional (the rest of the platform names
no env; a user's env registered as `their_module:Name-v0` gets the same treatment as the shipped ones):

- `default_config()`: the `ToolEnvConfig` a run starts from before it sets the episode limits;
- `validation_tasks`: the shipped validation set `pacerl eval` and a run's evaluations use by default
  (`validation_tasks_for(training tasks)`: one that follows the training tasks);
- `extra_validation_tasks`: named validation sets a run's evaluations report separately (held-out forms);
- `warm_start_steps` and `demonstration(task, style, rng)`: the demonstration styles the env writes,
  with their default SFT steps, and the turns of one demonstration (none: no warm start);
  `warm_start_stages`: styles that are curricula of other styles, trained one after the other;
- `services(settings)`: what the env's tools need started for a run (the Search env's retriever).

Vectorised: `gymnasium.vector.SyncVectorEnv` works as it is; `AsyncVectorEnv` needs
`shared_memory=False` (observations are chat messages of any length, which no fixed shared buffer
holds; they travel through the worker pipes instead), and without it is refused at construction with
a message that says so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import gymnasium
from gymnasium.vector.utils import create_shared_memory

from pacerl.envs.parsing import Parsed, parse_actions
from pacerl.envs.rewards import Reward
from pacerl.envs.spaces import ChatMessages, Message, UnicodeText
from pacerl.envs.tasks import Task
from pacerl.envs.tools.core import Tool, ToolContext, ToolError, get_tool

log = logging.getLogger(__name__)


@create_shared_memory.register(ChatMessages)
@create_shared_memory.register(UnicodeText)
def _no_shared_memory(space: gymnasium.Space[Any], n: int = 1, ctx: Any = None) -> None:
    # A ValueError, not Gymnasium's CustomSpaceError, so that this message is the one the user reads
    # first: AsyncVectorEnv rewraps a CustomSpaceError in a generic one.
    raise ValueError(
        f"AsyncVectorEnv cannot hold {space} observations in shared memory: they are text of any length. "
        "Pass shared_memory=False, e.g. gymnasium.vector.AsyncVectorEnv(env_fns, shared_memory=False); "
        "observations then travel through the worker pipes. SyncVectorEnv needs nothing."
    )


class EpisodeLost(Exception):  # noqa: N818 (an event, like StopIteration, not a bug report)
    """Raised by an env (a proxy of one on a remote worker) that lost its episode's state and cannot
    rebuild it; the rollout driver plays the episode again from its start under the same id. Not a
    RuntimeError on purpose: the driver's handling of failed engine calls must not swallow it."""


@dataclass(frozen=True)
class ToolEnvConfig:
    """Episode limits and tool handling, shared by every tool env."""

    max_turns: int = 4
    """Assistant messages per episode; past it the episode is truncated."""
    max_tool_calls: int = 4
    """Tool calls per episode; a call beyond it is refused and the episode truncated."""
    max_context_chars: int = 32_000
    """Characters of conversation (all messages) before the episode is truncated (the context budget)."""
    tool_formats: tuple[str, ...] = ("hermes", "code", "json")
    """How tool calls are written: `hermes` <tool_call> JSON, fenced `code` blocks, `json` whole-message
    calls (Llama 3.x, Mistral): `pacerl.envs.parsing`."""
    on_tool_error: Literal["continue", "truncate"] = "continue"
    """After a failed tool call (timeout, service down, bad call): let the model react, or end the episode."""
    format_weight: float = 0.0
    """Reward for a well-formed but wrong final answer (0 disables)."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """Settings handed to tools (e.g. `retriever_url` for search)."""
    system_prompt: str | None = None
    """The system message posing every task: None uses the env's own, "" sends none (a tiny model that
    learned the tool format by SFT needs no instructions, and short prompts train much faster)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tool_calls < 0 or self.max_context_chars < 1:
            raise ValueError("max_turns and max_context_chars must be >= 1, max_tool_calls >= 0")
        if self.on_tool_error not in ("continue", "truncate"):
            raise ValueError(f"on_tool_error must be continue or truncate, got {self.on_tool_error!r}")


class ToolEnv(gymnasium.Env[tuple[Message, ...], str]):
    """Base class of pacerl's tool environments (see each subclass's docstring for the details).

    The constructor takes the env's settings as keyword arguments too, each a field of its config
    (`resolve_config`): `gymnasium.make("pacerl/CodeMath-v0", max_turns=1)`. A subclass with an
    `__init__` of its own takes `**config_fields` and hands them on (or to `resolve_config`)."""

    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 1}  # noqa: RUF012 (Gymnasium's name)
    tool_names: tuple[str, ...] = ()
    """Names of the registered tools this env offers."""
    validation_tasks: ClassVar[str | None] = None
    """The shipped validation set (a `load_tasks` name or path) that `pacerl eval` and a run's
    evaluations use when no tasks are named; None: they must be named."""
    extra_validation_tasks: ClassVar[Mapping[str, str]] = {}
    """Further validation sets a run evaluates beside the main one, each reported on its own under its
    name (`eval/<name>/accuracy`), e.g. CodeMath's question forms held out of training."""
    warm_start_steps: ClassVar[Mapping[str, int]] = {}
    """The demonstration styles `demonstration` writes, each with its default SFT steps for a fresh
    model; the first is the default style. Empty: no demonstrations (a fresh model trains without a
    warm start)."""
    warm_start_stages: ClassVar[Mapping[str, Sequence[str]]] = {}
    """Styles of `warm_start_steps` that are curricula rather than demonstrations: the styles trained one
    after the other, the curriculum's steps split evenly between them, each stage with its own
    optimizer and learning-rate warm-up (CodeMath's skill first, then the teacher's habit)."""

    def __init__(
        self,
        tasks: Sequence[Task],
        config: ToolEnvConfig | None = None,
        render_mode: str | None = None,
        **config_fields: Any,
    ) -> None:
        if not tasks:
            raise ValueError("an env needs at least one task")
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.tasks = list(tasks)
        self.config = self.resolve_config(config, **config_fields)
        self.render_mode = render_mode
        self.tools: dict[str, Tool] = {name: get_tool(name) for name in self.tool_names}
        self.observation_space = ChatMessages()
        self.action_space = UnicodeText()
        self._context: ToolContext | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: Task | None = None
        self._done = True
        self._transcript: list[Message] = []
        self._reset_counters()

    # -- what training and evaluation ask of the class (optional) ------------------------------------------

    @classmethod
    def default_config(cls) -> ToolEnvConfig:
        """The config a run starts from for this env, before it sets the episode limits and prompt."""
        return ToolEnvConfig()

    @classmethod
    def resolve_config(cls, config: ToolEnvConfig | None = None, **fields: Any) -> ToolEnvConfig:
        """The env's settings: `config` (default `default_config()`) with each keyword that names one
        of its fields replacing that field, so `gymnasium.make(id, max_turns=1)` works; keywords win
        over `config=` when both are given (a keyword replaces the whole field: `settings=` the whole
        mapping). A keyword that is no field is a TypeError that lists the fields."""
        base = config if config is not None else cls.default_config()
        names = [spec.name for spec in dataclasses.fields(base)]
        unknown = sorted(set(fields) - set(names))
        if unknown:
            raise TypeError(
                f"{cls.__name__} got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                f"its settings are the fields of {type(base).__name__}: {', '.join(names)}"
            )
        if isinstance(fields.get("tool_formats"), list):  # a list from a JSON or TOML config
            fields["tool_formats"] = tuple(fields["tool_formats"])
        return dataclasses.replace(base, **fields) if fields else base

    @classmethod
    def validation_tasks_for(cls, training_tasks: str | None) -> str | None:
        """The validation set of a run that trains on `training_tasks` (its `env.tasks`; None: the
        env's default): `validation_tasks` unless the env evaluates what it trains on (ReasoningGym-v0:
        the training datasets at the evaluation seed)."""
        return cls.validation_tasks

    @classmethod
    def services(cls, settings: Mapping[str, Any]) -> contextlib.AbstractContextManager[Mapping[str, Any]]:
        """Start what this env's tools need for a run unless `settings` (the tool settings the run was
        given) already point at it; the context yields the tool settings to add and stops what it
        started on exit. Default: nothing to start."""
        return contextlib.nullcontext({})

    def demonstration(self, task: Task, style: str, rng: random.Random) -> list[Message]:
        """The assistant and tool turns of a correct episode on `task` after `initial_messages(task)`,
        written in `style` (a key of `warm_start_steps`); `rng` makes any random choice. Tool turns hold
        what the tool would return."""
        raise NotImplementedError(f"{type(self).__name__} writes no demonstrations")

    # -- what a subclass decides -------------------------------------------------------------------------

    def initial_messages(self, task: Task) -> list[Message]:
        """The system and user messages that pose `task`."""
        raise NotImplementedError

    def pose(self, default_system_prompt: str, question: str) -> list[Message]:
        """A system message (`config.system_prompt`, else the env's default; none if empty) and the
        question as the user message."""
        system = self.config.system_prompt
        system = default_system_prompt if system is None else system
        user: Message = {"role": "user", "content": question}
        return [{"role": "system", "content": system}, user] if system else [user]

    def score(self, task: Task, final_message: str) -> Reward:
        """The reward of an episode whose last assistant message is `final_message`."""
        raise NotImplementedError

    def parse(self, action: str) -> Parsed:
        """The tool calls in an assistant message (override to accept another format)."""
        return parse_actions(action, self.config.tool_formats)

    # -- Gymnasium -----------------------------------------------------------------------------------

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' OpenAI schemas, for the chat template."""
        return [tool.schema() for tool in self.tools.values()]

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[tuple[Message, ...], dict[str, Any]]:
        """Start an episode on `options["task"]` (a Task or a row dict), `options["task_id"]`, or a task
        drawn with the env's seeded generator."""
        super().reset(seed=seed)
        self._release_context()
        self._task = self._choose_task(options or {})
        self._context = ToolContext(self.config.settings)
        self._done = False
        self._reset_counters()
        observation = tuple(self.initial_messages(self._task))
        self._chars = sum(len(m["content"]) for m in observation)
        self._transcript = list(observation)
        return observation, {"task_id": self._task.id, "tools": list(self.tools)}

    def _choose_task(self, options: Mapping[str, Any]) -> Task:
        if "task" in options:
            task = options["task"]
            return task if isinstance(task, Task) else Task.from_row(task)
        if "task_id" in options:
            for task in self.tasks:
                if task.id == options["task_id"]:
                    return task
            raise KeyError(f"no task with id {options['task_id']!r}")
        return self.tasks[int(self.np_random.integers(len(self.tasks)))]

    def _reset_counters(self) -> None:
        self._turns = self._tool_calls = self._tool_errors = self._chars = 0
        self._transcript = []

    def step(self, action: str) -> tuple[tuple[Message, ...], float, bool, bool, dict[str, Any]]:
        """The sync face of `astep` (runs it on this env's own loop)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        loop = self._loop
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: no loop in this thread
            return loop.run_until_complete(self.astep(action))
        # Called from async code (a notebook, a test): run on the env's loop in a helper thread.
        with concurrent.futures.ThreadPoolExecutor(1) as worker:
            return worker.submit(loop.run_until_complete, self.astep(action)).result()

    async def astep(self, action: str) -> tuple[tuple[Message, ...], float, bool, bool, dict[str, Any]]:
        """Take the assistant's message: run its tool calls, or end the episode on a final answer."""
        task, info = self._take_message(action)
        parsed = self.parse(action) if self.tools else Parsed()
        if not parsed.attempted:  # no call: this is the final answer
            reward = self.score(task, action)
            self._done = True
            await self._arelease_context()
            return (), reward.total, True, False, self._info(info, reward, [], None)

        responses, step_errors, truncation = await self._run_calls(parsed)
        self._chars += sum(len(m["content"]) for m in responses)
        self._transcript.extend(responses)
        if truncation is None and step_errors and self.config.on_tool_error == "truncate":
            truncation = "tool_error"
        if truncation is None and self._turns >= self.config.max_turns:
            truncation = "max_turns"
        if truncation is None and self._chars > self.config.max_context_chars:
            truncation = "context_budget"
        self._done = truncation is not None
        if self._done:
            await self._arelease_context()
        no_reward = Reward(0.0, 0.0, 0.0)
        return tuple(responses), 0.0, False, self._done, self._info(info, no_reward, step_errors, truncation)

    def _take_message(self, action: str) -> tuple[Task, dict[str, Any]]:
        """What every step does first, whatever it does next (an `astep` of a subclass too): refuse a step
        outside an episode or an action that is no text, count the turn and its characters, keep the
        message in the transcript; the episode's task and the step's first info."""
        if self._task is None or self._done:
            raise RuntimeError("the episode has ended (or never began): call reset() first")
        if not isinstance(action, str):
            raise TypeError(f"an action is the assistant's message text (str), got {type(action).__name__}")
        self._turns += 1
        self._chars += len(action)
        self._transcript.append({"role": "assistant", "content": action})
        return self._task, {"task_id": self._task.id, "turn": self._turns}

    async def _run_calls(self, parsed: Parsed) -> tuple[list[Message], list[str], str | None]:
        assert self._context is not None
        responses: list[Message] = []
        errors: list[str] = []
        for problem in parsed.errors:
            errors.append(problem.message)
            responses.append({"role": "tool", "name": "error", "content": f"Error: {problem.message}"})
        for call in parsed.calls:
            if self._tool_calls >= self.config.max_tool_calls:
                message = f"the budget of {self.config.max_tool_calls} tool calls is used up"
                errors.append(message)
                responses.append({"role": "tool", "name": call.name, "content": f"Error: {message}"})
                return responses, errors, "max_tool_calls"
            self._tool_calls += 1
            tool = self.tools.get(call.name)
            if tool is None:
                message = f"unknown tool {call.name!r}; available: {', '.join(self.tools)}"
                errors.append(message)
                responses.append({"role": "tool", "name": call.name, "content": f"Error: {message}"})
                continue
            try:
                content = await tool(call.arguments, self._context)
            except ToolError as error:
                errors.append(str(error))
                content = f"Error: {error}"
            except Exception as error:  # a bug in a tool must not cost the episode; it is logged loudly
                log.exception("tool %s failed", call.name)
                errors.append(f"internal error in tool {call.name}: {type(error).__name__}")
                content = f"Error: the tool {call.name} failed internally ({type(error).__name__})"
            responses.append({"role": "tool", "name": call.name, "content": content})
        self._tool_errors += len(errors)
        return responses, errors, None

    def _info(
        self, info: dict[str, Any], reward: Reward, errors: list[str], truncation: str | None
    ) -> dict[str, Any]:
        info.update(
            reward_breakdown=reward.breakdown(),
            tool_calls=self._tool_calls,
            tool_errors=self._tool_errors,
            step_errors=errors,
            error=bool(errors),
            truncation_reason=truncation,
        )
        return info

    def render(self) -> str | None:
        """The transcript so far as text (render_mode "ansi")."""
        if self.render_mode != "ansi":
            return None
        return "\n".join(f"[{m['role']}] {m['content']}" for m in self._transcript)

    async def _arelease_context(self) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            await context.aclose()

    def _release_context(self) -> None:
        if self._context is not None:
            self._context.close()
            self._context = None

    @property
    def sandbox_sessions_open(self) -> int:
        """Sandbox sessions this episode holds right now (0 before first use and after the end)."""
        return self._context.sessions_open if self._context is not None else 0

    def close(self) -> None:
        """Release the episode's sandbox sessions and the private loop. Idempotent."""
        self._release_context()
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        self._done = True
        super().close()
