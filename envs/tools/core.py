"""A tool is one typed Python function with a docstring.

    @tool(sandbox=SandboxPolicy(limits=Limits(timeout_s=5)))
    async def python(code: str, ctx: ToolContext) -> str:
        '''Run Python code in a persistent interpreter.

        Args:
            code: Python source; print what you want to see.
        '''

The JSON schema (OpenAI function-calling form) comes from the signature and the docstring's Args
section; arguments a model sends are validated against the same signature (pydantic), and a bad call
comes back as text the model can read. A parameter annotated `ToolContext` is injected, not shown to
the model: through it a tool reaches its episode's sandbox session (started at first use, released
when the episode closes) and the env's settings. Expected failures are `ToolError`s; the text goes to
the model. So does a `SandboxUsageError`: the sandbox refusing, before it runs anything, what the
model's arguments hold (a NUL byte, code over the size cap, a file path no sandbox can write).
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import os
import re
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_type_hints, overload

import pydantic

from pacerl.sandbox import ExecResult, Limits, Sandbox, SandboxUsageError, Session


class ToolError(Exception):
    """An expected failure (bad arguments, a timeout, a service down); its text goes to the model."""


@dataclass(frozen=True)
class SandboxPolicy:
    """Where a tool's code runs and under which limits."""

    backend: str = "local"
    """Sandbox backend: local, docker or remote."""
    limits: Limits = field(default_factory=lambda: Limits(timeout_s=10))
    """Limits of each call."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Backend options (e.g. `image` for docker, `url` for remote)."""

    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        return self.backend, tuple(sorted((k, repr(v)) for k, v in self.options.items()))


SANDBOX_POLICIES = "sandbox_policies"
"""The env setting (`ToolEnvConfig.settings`) that replaces tools' declared sandbox policies, by tool
name: `{"python": SandboxPolicy(backend="docker", ...)}` (a run config's `env.sandbox`)."""


_SANDBOXES: dict[tuple[str, tuple[tuple[str, str], ...]], Sandbox] = {}
_SANDBOXES_LOCK = threading.Lock()


def shared_sandbox(policy: SandboxPolicy) -> Sandbox:
    """One `Sandbox` per backend and options in this process (each owns a loop thread and a warm pool)."""
    with _SANDBOXES_LOCK:
        sandbox = _SANDBOXES.get(policy.key())
        if sandbox is None:
            sandbox = Sandbox(policy.backend, limits=policy.limits, **dict(policy.options))
            _SANDBOXES[policy.key()] = sandbox
        return sandbox


@atexit.register
def _close_shared_sandboxes() -> None:
    with _SANDBOXES_LOCK:
        for sandbox in _SANDBOXES.values():
            sandbox.close()
        _SANDBOXES.clear()


def _forget_shared_sandboxes() -> None:
    # A forked child (Gymnasium's AsyncVectorEnv forks by default) inherits the parent's sandboxes
    # without their loop threads, and its first tool call would wait forever on one: it starts its own.
    # A new lock too: the parent's may have been held at the fork.
    global _SANDBOXES_LOCK
    _SANDBOXES.clear()
    _SANDBOXES_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_shared_sandboxes)


class ToolContext:
    """One episode's tool resources: sandbox sessions (lazy, one per policy) and the env's settings."""

    def __init__(self, settings: Mapping[str, Any] | None = None) -> None:
        self.settings: Mapping[str, Any] = dict(settings or {})
        """Env-level settings tools read (e.g. `retriever_url`)."""
        self._sessions: dict[tuple[str, tuple[tuple[str, str], ...]], Session] = {}
        self._policy: SandboxPolicy | None = None

    def bound(self, policy: SandboxPolicy | None) -> ToolContext:
        """A view of this context for one tool (its sandbox policy), sharing the sessions."""
        view = ToolContext.__new__(ToolContext)
        view.settings, view._sessions, view._policy = self.settings, self._sessions, policy
        return view

    def session(self) -> Session:
        """The episode's persistent interpreter under the calling tool's policy (created at first use)."""
        policy = self._require_policy()
        key = policy.key()
        if key not in self._sessions:
            self._sessions[key] = shared_sandbox(policy).session(policy.limits)
        return self._sessions[key]

    async def run(self, code: str, language: str = "python", stdin: str | bytes | None = None) -> ExecResult:
        """A one-shot run in a fresh sandbox under the calling tool's policy."""
        policy = self._require_policy()
        return await shared_sandbox(policy).arun(code, language, stdin=stdin, limits=policy.limits)

    def _require_policy(self) -> SandboxPolicy:
        if self._policy is None:
            raise RuntimeError(
                "this tool declared no sandbox policy; pass sandbox=SandboxPolicy(...) to @tool"
            )
        return self._policy

    @property
    def sessions_open(self) -> int:
        """How many sandbox sessions this episode holds (for tests of the release)."""
        return sum(1 for s in self._sessions.values() if s.started)

    async def aclose(self) -> None:
        """Release every session. Idempotent."""
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.aclose()

    def close(self) -> None:
        """The sync twin of `aclose`."""
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            session.close()


@dataclass(frozen=True)
class Tool:
    """A registered tool: the function, its schema and its sandbox policy."""

    name: str
    description: str
    function: Callable[..., Any]
    arguments: type[pydantic.BaseModel]
    """The model-visible parameters as a pydantic model (validation and JSON schema)."""
    context_parameter: str | None
    """Name of the injected `ToolContext` parameter, if any."""
    sandbox: SandboxPolicy | None
    max_concurrency: int
    _gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = field(
        default_factory=weakref.WeakKeyDictionary, compare=False, repr=False
    )

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling schema (what chat templates render)."""
        parameters = self.arguments.model_json_schema()
        parameters.pop("title", None)
        for prop in parameters.get("properties", {}).values():
            prop.pop("title", None)
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": parameters},
        }

    def policy_in(self, settings: Mapping[str, Any]) -> SandboxPolicy | None:
        """The sandbox policy this tool runs under with the env's `settings`: the one they name for it
        (`SANDBOX_POLICIES`), else its declared one; a tool that declared none uses no sandbox."""
        if self.sandbox is None:
            return None
        chosen = settings.get(SANDBOX_POLICIES, {}).get(self.name, self.sandbox)
        if not isinstance(chosen, SandboxPolicy):
            raise TypeError(f"settings[{SANDBOX_POLICIES!r}][{self.name!r}] is a {type(chosen).__name__}")
        return chosen

    async def __call__(self, arguments: Mapping[str, Any], context: ToolContext) -> str:
        """Validate `arguments`, run the tool, and return its text; ToolError for anything expected."""
        try:
            validated = self.arguments.model_validate(dict(arguments))
        except pydantic.ValidationError as error:
            raise ToolError(f"invalid arguments for {self.name}: {_explain(error)}") from None
        kwargs = {name: getattr(validated, name) for name in type(validated).model_fields}
        if self.context_parameter is not None:
            kwargs[self.context_parameter] = context.bound(self.policy_in(context.settings))
        loop = asyncio.get_running_loop()
        gate = self._gates.setdefault(loop, asyncio.Semaphore(self.max_concurrency))
        async with gate:
            try:
                result = self.function(**kwargs)
                if inspect.isawaitable(result):
                    result = await result
            except SandboxUsageError as error:
                # The sandbox refused what the model wrote (a NUL byte, code over the cap, a file path
                # it cannot write) before running anything: a bad argument, not a broken platform.
                raise ToolError(f"the sandbox refused this call: {error}") from None
        if not isinstance(result, str):
            raise TypeError(f"tool {self.name} returned {type(result).__name__}, not str")
        return result


def _explain(error: pydantic.ValidationError) -> str:
    parts = []
    for item in error.errors()[:5]:
        where = ".".join(str(p) for p in item["loc"]) or "arguments"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


TOOLS: dict[str, Tool] = {}
"""Every registered tool by name."""


@overload
def tool(function: Callable[..., Any], /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    sandbox: SandboxPolicy | None = None,
    max_concurrency: int = 64,
    register: bool = True,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    function: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    sandbox: SandboxPolicy | None = None,
    max_concurrency: int = 64,
    register: bool = True,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a `Tool` from a typed function (usable bare, `@tool`, or with options, `@tool(...)`)."""

    def build(fn: Callable[..., Any]) -> Tool:
        made = make_tool(fn, name=name, sandbox=sandbox, max_concurrency=max_concurrency)
        if register:
            if made.name in TOOLS and TOOLS[made.name].function is not fn:
                raise ValueError(f"a tool named {made.name!r} is already registered")
            TOOLS[made.name] = made
        return made

    return build(function) if function is not None else build


def make_tool(
    fn: Callable[..., Awaitable[str] | str],
    *,
    name: str | None = None,
    sandbox: SandboxPolicy | None = None,
    max_concurrency: int = 64,
) -> Tool:
    """Build a Tool without registering it."""
    doc = inspect.getdoc(fn)
    if not doc:
        raise ValueError(f"tool {fn.__name__} needs a docstring: it is the description the model reads")
    description, arg_docs = _split_docstring(doc)
    hints = get_type_hints(fn, include_extras=True)
    fields: dict[str, Any] = {}
    context_parameter = None
    for parameter in inspect.signature(fn).parameters.values():
        annotation = hints.get(parameter.name)
        if annotation is ToolContext:
            context_parameter = parameter.name
            continue
        if annotation is None:
            raise ValueError(f"tool {fn.__name__}: parameter {parameter.name!r} needs a type annotation")
        default = ... if parameter.default is inspect.Parameter.empty else parameter.default
        fields[parameter.name] = (
            annotation,
            pydantic.Field(default, description=arg_docs.get(parameter.name)),
        )
    model = pydantic.create_model(
        f"{fn.__name__}_arguments", __config__=pydantic.ConfigDict(extra="forbid", strict=False), **fields
    )
    return Tool(name or fn.__name__, description, fn, model, context_parameter, sandbox, max_concurrency)


def _split_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Description (the text before `Args:`) and per-argument descriptions (Google style)."""
    head, _, tail = doc.partition("\nArgs:")
    arg_docs: dict[str, str] = {}
    current = None
    for line in tail.splitlines():
        match = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
        if match and (current is None or len(line) - len(line.lstrip()) <= 4):
            current = match.group(1)
            arg_docs[current] = match.group(2).strip()
        elif current and line.strip() and line.startswith(" "):
            arg_docs[current] += " " + line.strip()
        elif line.strip() and not line.startswith(" "):
            break  # a new section (Returns:, Raises:)
    paragraphs = [" ".join(block.split()) for block in head.strip().split("\n\n")]
    return "\n\n".join(paragraphs), arg_docs


def get_tool(name: str) -> Tool:
    """The registered tool called `name`, or a KeyError listing the known ones."""
    try:
        return TOOLS[name]
    except KeyError:
        raise KeyError(f"no tool named {name!r}; registered: {', '.join(sorted(TOOLS))}") from None
