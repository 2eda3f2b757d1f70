"""pacerl/BFCL-MultiTurn-v0: BFCL v4's multi-turn function calling (base, miss_func, miss_param,
long_context) from the installed `bfcl-eval` package, scored by BFCL's own multi-turn verdict."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pacerl.envs.base import ToolEnv, ToolEnvConfig
from pacerl.envs.bfcl_backends import (
    ADDED_FUNCTIONS_NOTE,
    BFCL_INSTRUCTION,
    CALL_FORMAT,
    ERROR_PREFIX,
    STEP_LIMIT,
    Backends,
    TurnFailure,
    argument_problem,
    function_docs,
    judge_turn,
    openai_schema,
    type_warning,
)
from pacerl.envs.parsing import Parsed
from pacerl.envs.rewards import Reward
from pacerl.envs.spaces import Message
from pacerl.envs.tasks import Task, load_tasks

SYSTEM_PROMPT = (
    f"{BFCL_INSTRUCTION}\n\n{CALL_FORMAT}; its result comes back to you.\n\n"
    "At each turn, you should try your best to complete the tasks requested by the user within the "
    "current turn. Continue to output functions to call until you have fulfilled the user's request to "
    "the best of your ability. Once you have no more functions to call, the system will consider the "
    "current turn complete and proceed to the next turn or task."
)
"""BFCL's multi-turn instructions (its `classic` prompt style), with pacerl's call format."""


class BFCLMultiTurnEnv(ToolEnv):
    """## Description
    BFCL v4 multi-turn (Patil et al., the Berkeley Function Calling Leaderboard): a user asks for
    several things in turn; the model calls functions of stateful backends (a file system, messaging,
    posting, ticketing, trading, travel booking, a vehicle, math) to do each. The backends are
    bfcl-eval's own classes, one fresh set per episode, loaded from the entry's initial state; they run
    in this process (pure in-memory state machines; see `pacerl.envs.bfcl_backends`).

    ## Action
    The assistant's message. Calls as Hermes `<tool_call>` JSON (or whole-message JSON calls); each is
    run as a structured call: the function looked up by name among those offered, its arguments
    checked against BFCL's function doc, then passed as keywords.

    ## Observation
    On reset: the system prompt and the first user turn. After a message with calls: one `tool`
    message per call (its result, or an error the model can read). After a message without calls, when
    user turns remain: the next user turn (role `user`); a miss_func turn adds the held-out functions
    (to `tool_schemas()` from then on, and listed as JSON in that user message, since the prompt's
    tools were rendered at the start). Empty when the episode ends.

    ## Rewards
    BFCL's multi-turn verdict, 1 or 0, given at termination: after each user turn, the turn's ground
    truth is executed on a second set of backends and, unless it is empty (a turn the model cannot do),
    the model must have called something this turn, every backend's public state must equal the ground
    truth's, and the ground truth's results must all be among the model's results so far
    (`multi_turn_checker`'s empty-turn, state and response checks). `info["bfcl"]` and the reward
    breakdown name the first failing turn and check.

    ## Episode End
    Terminated when the last user turn ends (a message without calls). Truncated, reward 0, when a user
    turn has more than 20 messages with calls before its last (BFCL's force-quit), or at `max_turns`
    messages, `max_tool_calls` calls or `max_context_chars` characters.

    ## Arguments
    `tasks`: a BFCL task set name (`bfcl:multi_turn`, `bfcl:multi_turn_base`, a comma list of categories,
    each optionally `/train` or `/eval`: `bfcl_split`), another `load_tasks` source, or `Task`s from
    `bfcl_tasks` (default `bfcl:multi_turn/train`; validation `bfcl:multi_turn/eval`);
    `config`: a `ToolEnvConfig` (its fields are keyword arguments too); `render_mode`: None or "ansi".

    ## Version History
    - v0: first version.
    """

    validation_tasks = "bfcl:multi_turn/eval"

    def __init__(
        self,
        tasks: str | Sequence[Task] = "bfcl:multi_turn/train",
        config: ToolEnvConfig | None = None,
        render_mode: str | None = None,
        **config_fields: Any,
    ) -> None:
        tasks = load_tasks(tasks) if isinstance(tasks, str) else tasks
        super().__init__(tasks, config, render_mode, **config_fields)
        self._episode: _Episode | None = None

    @classmethod
    def default_config(cls) -> ToolEnvConfig:
        """Room for a whole BFCL entry: up to 8 user turns of up to 20 call messages, long_context's
        large results; `hermes` and `json` calls (no ```python blocks: there is no python tool)."""
        return ToolEnvConfig(
            max_turns=160, max_tool_calls=400, max_context_chars=1_000_000, tool_formats=("hermes", "json")
        )

    def initial_messages(self, task: Task) -> list[Message]:
        return self.pose(SYSTEM_PROMPT, _user_text(task.metadata["turns"][0]))

    def score(self, task: Task, final_message: str) -> Reward:
        """The verdict of the episode so far (every ended turn judged)."""
        failure = self._episode.failure if self._episode is not None else None
        passed = float(failure is None)
        extra = {} if failure is None else {"failed_turn": float(failure.turn)}
        return Reward(passed, passed, 0.0, extra)

    def final_answer(self, final_message: str) -> str | None:
        """None: BFCL judges states and results, not an answer."""
        return None

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI schemas of the functions available now (a miss_func turn adds its held-out ones)."""
        if self._episode is None:
            return []
        return [openai_schema(doc) for doc in self._episode.docs.values()]

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[tuple[Message, ...], dict[str, Any]]:
        observation, info = super().reset(seed=seed, options=options)
        assert self._task is not None
        self._episode = _Episode(self._task)
        return observation, {**info, "tools": list(self._episode.docs)}

    async def astep(self, action: str) -> tuple[tuple[Message, ...], float, bool, bool, dict[str, Any]]:
        """Run the message's calls, or end the user turn: pose the next one, or end the episode."""
        _, info = self._take_message(action)
        episode = self._episode
        assert episode is not None  # reset sets it with the task
        parsed = self.parse(action)
        info["user_turn"] = episode.turn
        truncation = None
        errors: list[str] = []
        if parsed.attempted:
            responses, errors, truncation = self._run(parsed)
            if episode.steps > STEP_LIMIT and truncation is None:
                if episode.last_turn:  # BFCL still judges an entry whose last turn was force-quit
                    episode.end_turn()
                    return self._finish(info, errors)
                truncation = "step_limit"
        else:
            episode.end_turn()
            if episode.last_turn_ended:
                return self._finish(info, [])
            responses = [{"role": "user", "content": episode.next_turn()}]
        self._chars += sum(len(m["content"]) for m in responses)
        self._transcript.extend(responses)
        if truncation is None and self._turns >= self.config.max_turns:
            truncation = "max_turns"
        if truncation is None and self._chars > self.config.max_context_chars:
            truncation = "context_budget"
        self._done = truncation is not None
        info["bfcl"] = episode.summary()
        return (
            tuple(responses),
            0.0,
            False,
            self._done,
            self._info(info, Reward(0.0, 0.0, 0.0), errors, truncation),
        )

    def _finish(
        self, info: dict[str, Any], errors: list[str]
    ) -> tuple[tuple[Message, ...], float, bool, bool, dict[str, Any]]:
        assert self._task is not None and self._episode is not None
        self._done = True
        reward = self.score(self._task, "")
        info["bfcl"] = self._episode.summary()
        return (), reward.total, True, False, self._info(info, reward, errors, None)

    def _run(self, parsed: Parsed) -> tuple[list[Message], list[str], str | None]:
        """The tool messages of a message's calls: malformed ones first, then each call in order,
        stopping at the episode's call budget."""
        assert self._episode is not None
        episode = self._episode
        responses: list[Message] = []
        errors: list[str] = []
        for problem in parsed.errors:
            errors.append(problem.message)
            responses.append({"role": "tool", "name": "error", "content": f"Error: {problem.message}"})
        if parsed.calls:
            episode.steps += 1
        for call in parsed.calls:
            if self._tool_calls >= self.config.max_tool_calls:
                message = f"the budget of {self.config.max_tool_calls} tool calls is used up"
                errors.append(message)
                responses.append({"role": "tool", "name": call.name, "content": f"Error: {message}"})
                self._tool_errors += len(errors)
                return responses, errors, "max_tool_calls"
            self._tool_calls += 1
            result, failed = episode.call(call.name, call.arguments)
            if failed:
                errors.append(result)
            warning = episode.type_warning(call.name, call.arguments)
            content = result if warning is None else f"{result}\n{warning}"
            responses.append({"role": "tool", "name": call.name, "content": content})
        self._tool_errors += len(errors)
        return responses, errors, None

    def close(self) -> None:
        self._episode = None
        super().close()


def _user_text(messages: Sequence[Message]) -> str:
    return "\n".join(m["content"] for m in messages if m["role"] == "user")


class _Episode:
    """One entry's play: the model's and the ground truth's backends, the user turn, its steps, the
    results so far and the first failed check."""

    def __init__(self, task: Task) -> None:
        meta = task.metadata
        self.task = task
        long_context = meta["category"] == "multi_turn_long_context"
        self.model = Backends(meta["involved_classes"], meta["initial_config"], long_context)
        self.truth = Backends(meta["involved_classes"], meta["initial_config"], long_context)
        self.held_out = {int(turn): list(names) for turn, names in meta.get("missed_function", {}).items()}
        hidden = {name for names in self.held_out.values() for name in names}
        every = {doc["name"]: doc for cls in meta["involved_classes"] for doc in function_docs(cls)}
        self.hidden_docs = {name: every[name] for name in hidden}
        self.docs = {name: doc for name, doc in every.items() if name not in hidden}
        self.turn = 0
        self.steps = 0
        self.results: list[str] = []
        self.failure: TurnFailure | None = None
        self.turns_judged = 0

    @property
    def last_turn(self) -> bool:
        return self.turn == len(self.task.metadata["turns"]) - 1

    @property
    def last_turn_ended(self) -> bool:
        return self.turns_judged == len(self.task.metadata["turns"])

    def call(self, name: str, arguments: Any) -> tuple[str, bool]:
        """(the call's result or error text, whether it failed); every call's text joins the model's
        results, as BFCL's executor records a call that raised."""
        # A held-out function runs before it is offered, as in BFCL, whose executor knows every
        # function of the entry's classes (its ground truth of miss_func_49 calls `tail` two turns early).
        doc = self.docs.get(name) or self.hidden_docs.get(name)
        if doc is None or name not in self.model.owner:
            problem: str | None = (
                f"no function named {name!r} is available; functions: {', '.join(self.docs)}"
            )
        elif not isinstance(arguments, dict):
            problem = f"the arguments of {name} must be a JSON object"
        else:
            problem = argument_problem(doc, arguments)
        self.results.append(f"{ERROR_PREFIX}{problem}" if problem else self.model.call(name, arguments))
        return self.results[-1], self.results[-1].startswith(ERROR_PREFIX)

    def type_warning(self, name: str, arguments: Any) -> str | None:
        """A note on arguments whose JSON types differ from the doc's (the call ran regardless)."""
        doc = self.docs.get(name) or self.hidden_docs.get(name)
        return type_warning(doc, arguments) if doc is not None and isinstance(arguments, dict) else None

    def end_turn(self) -> None:
        """Judge the user turn that just ended (until the first failure, as BFCL's checker stops)."""
        truth = self.task.metadata["ground_truth"][self.turn]
        if self.failure is None:
            self.failure = judge_turn(self.turn, truth, self.steps, self.results, self.model, self.truth)
        self.turns_judged += 1

    def next_turn(self) -> str:
        """Advance to the next user turn; its user message (a miss_func turn: the added functions)."""
        self.turn += 1
        self.steps = 0
        added = self.held_out.get(self.turn, [])
        if not added:
            return _user_text(self.task.metadata["turns"][self.turn])
        docs = [self.hidden_docs[name] for name in added]
        self.docs.update({doc["name"]: doc for doc in docs})
        listed = json.dumps([openai_schema(doc)["function"] for doc in docs])
        return f"{listed}\n{ADDED_FUNCTIONS_NOTE}"

    def summary(self) -> dict[str, Any]:
        """What info reports: the user turn, turns judged, and the first failure."""
        failure = self.failure
        return {
            "user_turn": self.turn,
            "user_turns": len(self.task.metadata["turns"]),
            "turns_judged": self.turns_judged,
            "failed_turn": None if failure is None else failure.turn,
            "failed_check": None if failure is None else failure.check,
            "failure_detail": None if failure is None else failure.detail,
        }
