"""pacerl/ReasoningGym-v0 and the `reasoning_gym:` task source: reasoning-gym's procedural datasets
(100+ generators: arithmetic, algebra, logic, games, graphs, ...) as training tasks and evaluation sets,
each answer judged by its dataset's own `score_answer`. Needs the reasoning-gym extra
(`pip install 'pacerl[reasoning-gym]'`), imported only when a task is generated or scored.

A source names datasets and options, `reasoning_gym:<dataset>[,<dataset>...][?<option>=<value>&...]`:

    reasoning_gym:basic_arithmetic                     # 1,000 training tasks, seed 0
    reasoning_gym:basic_arithmetic?size=500&seed=3     # 500, seed 3
    reasoning_gym:basic_arithmetic,leg_counting        # a mixture: reasoning-gym's composite, equal weights
    reasoning_gym:basic_arithmetic?max_terms=3         # a field of the dataset's own config
    reasoning_gym:leg_counting?split=eval              # the evaluation set: 50 tasks at the reserved seed

Seed discipline. reasoning-gym derives entry `i` of seed `s` from `Random(s + i)`, so seed `s` with size
`n` spans the generator seeds `[s, s + n)`. Evaluation owns `[EVALUATION_SEED, EVALUATION_SEED +
EVALUATION_SPAN)`: `split=eval` generates there (a seed cannot be named with it), and a training source
whose span reaches into it is refused. A small generator repeats questions across seeds, so a training
source also drops every task whose question is one of the first `EVALUATION_SIZE` evaluation questions of
its datasets (the env's validation sets and the `reasoning-gym` suite's default size): training never
shows a question those evaluations ask.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pacerl.envs.base import ToolEnv, ToolEnvConfig
from pacerl.envs.rewards import Reward, outcome_reward
from pacerl.envs.spaces import Message
from pacerl.envs.tasks import Task, load_tasks

log = logging.getLogger(__name__)

SOURCE_PREFIX = "reasoning_gym:"
"""How a `load_tasks` source names reasoning-gym datasets."""
EVALUATION_SEED = 1_000_000_000
"""The seed of every evaluation set (`split=eval`); no training source may span it."""
EVALUATION_SPAN = 1_000_000
"""Generator seeds from `EVALUATION_SEED` on that evaluation owns (and the largest evaluation size)."""
EVALUATION_SIZE = 50
"""Tasks per evaluation set by default; a training source drops the questions of these."""
TRAINING_SIZE = 1000
"""Tasks of a training source by default."""
TRAINING_SEED = 0
"""The seed of a training source by default."""
DEFAULT_TASKS = "reasoning_gym:basic_arithmetic"
"""pacerl/ReasoningGym-v0's training tasks by default."""
METADATA_KEY = "reasoning_gym"
"""The `Task.metadata` key holding the dataset's entry, the dataset's name and its config options."""
INSTALL_HINT = "pip install 'pacerl[reasoning-gym]'"

SYSTEM_PROMPT = (
    "Solve the problem. You may run Python to compute or check: call the python tool with "
    '<tool_call>{"name": "python", "arguments": {"code": "print(...)"}}</tool_call> '
    "or write a ```python block; its output comes back to you. "
    "Then reply without tool calls and give only the final answer between <answer> and </answer> "
    "tags, in the form the question asks for."
)


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(f"reasoning-gym tasks need the reasoning-gym package: {INSTALL_HINT}") from None
    return reasoning_gym


@dataclass(frozen=True)
class ReasoningGymSource:
    """A parsed `reasoning_gym:` source."""

    datasets: tuple[str, ...]
    """reasoning-gym dataset names; more than one: a mixture (reasoning-gym's composite, equal weights)."""
    split: str = "train"
    """`train` (seed `seed`) or `eval` (seed `EVALUATION_SEED`)."""
    size: int = TRAINING_SIZE
    """Entries generated (a training source keeps those whose question no evaluation set asks)."""
    seed: int = TRAINING_SEED
    """The generator seed of a training source (`EVALUATION_SEED` for `split=eval`)."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """Fields of the dataset's own config (`max_terms=3`); a single dataset only."""

    @classmethod
    def parse(cls, source: str) -> ReasoningGymSource:
        """The source `reasoning_gym:<d1>[,<d2>...][?option=value&...]`; a ValueError says what is wrong.
        Options: `size`, `seed` (training only), `split` (`train` or `eval`), and any other is a field
        of the dataset's config, its value read as JSON when it parses (`3`, `true`, `["+", "-"]`)."""
        if not source.startswith(SOURCE_PREFIX):
            raise ValueError(f"{source!r} is not a reasoning-gym source ({SOURCE_PREFIX}<dataset>)")
        names, _, query = source.removeprefix(SOURCE_PREFIX).partition("?")
        datasets = tuple(name.strip() for name in names.split(","))
        if not all(datasets) or len(set(datasets)) != len(datasets):
            raise ValueError(f"{source!r}: name each dataset once, separated by commas")
        options: dict[str, Any] = {}
        for item in query.split("&") if query else ():
            key, sep, raw = item.partition("=")
            if not sep or not key or key in options:
                raise ValueError(f"{source!r}: options are key=value joined by '&', each once; got {item!r}")
            options[key] = _value(raw)
        split = options.pop("split", "train")
        if split not in ("train", "eval"):
            raise ValueError(f"{source!r}: split is train or eval, got {split!r}")
        if split == "eval" and "seed" in options:
            raise ValueError(f"{source!r}: an evaluation set has the reserved seed; name no seed")
        size = options.pop("size", EVALUATION_SIZE if split == "eval" else TRAINING_SIZE)
        seed = options.pop("seed", EVALUATION_SEED if split == "eval" else TRAINING_SEED)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{source!r}: size must be a positive integer, got {size!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"{source!r}: seed must be an integer >= 0, got {seed!r}")
        if options and len(datasets) > 1:
            raise ValueError(f"{source!r}: dataset options ({', '.join(options)}) need a single dataset")
        parsed = cls(datasets, split, size, seed, options)
        parsed.check(source)
        return parsed

    def check(self, source: str) -> None:
        """The seed discipline: an evaluation set fits the span evaluation owns; a training source's
        generator seeds stay out of it."""
        if self.split == "eval" and self.size > EVALUATION_SPAN:
            raise ValueError(f"{source!r}: an evaluation set holds at most {EVALUATION_SPAN} tasks")
        reserved = range(EVALUATION_SEED, EVALUATION_SEED + EVALUATION_SPAN)
        spanned = range(self.seed, self.seed + self.size)
        if self.split == "train" and max(reserved.start, spanned.start) < min(reserved.stop, spanned.stop):
            raise ValueError(
                f"{source!r}: seeds {spanned.start}..{spanned.stop - 1} reach into the generator seeds "
                f"reserved for evaluation ({reserved.start}..{reserved.stop - 1}); train on another "
                "seed, and evaluate with split=eval"
            )

    def text(self) -> str:
        """The source as `load_tasks` takes it (defaults written out)."""
        options: dict[str, Any] = {"split": self.split, "size": self.size}
        if self.split == "train":
            options["seed"] = self.seed
        options.update(self.config)
        query = "&".join(f"{key}={_text(value)}" for key, value in options.items())
        return f"{SOURCE_PREFIX}{','.join(self.datasets)}?{query}"

    def evaluation(self, size: int = EVALUATION_SIZE) -> ReasoningGymSource:
        """The evaluation set of the same datasets and config options."""
        return replace(self, split="eval", size=size, seed=EVALUATION_SEED)


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def is_reasoning_gym_source(source: object) -> bool:
    """Whether `source` is a `reasoning_gym:` task source."""
    return isinstance(source, str) and source.startswith(SOURCE_PREFIX)


def reasoning_gym_tasks(source: str) -> list[Task]:
    """The tasks of a `reasoning_gym:` source (`ReasoningGymSource.parse`), deterministic and cached:
    ids `<dataset>-<seed>-<index>`, each task's metadata holding its entry for the dataset's scorer. A
    ValueError names an unknown dataset, a config the dataset refuses or a seed evaluation owns."""
    return list(_tasks(ReasoningGymSource.parse(source).text()))


@functools.lru_cache(maxsize=32)
def _tasks(source: str) -> tuple[Task, ...]:
    spec = ReasoningGymSource.parse(source)
    tasks = [_task(spec, index, entry) for index, entry in enumerate(_entries(spec, source))]
    if spec.split == "train":
        asked = {
            entry["question"]
            for name in spec.datasets
            for entry in _entries(replace(spec, datasets=(name,)).evaluation(), source)
        }
        kept = [task for task in tasks if task.question not in asked]
        if len(kept) < len(tasks):
            log.info("%s: dropped %d tasks an evaluation set asks too", source, len(tasks) - len(kept))
        if not kept:
            raise ValueError(f"{source!r}: every question is one the evaluation set asks")
        tasks = kept
    return tuple(tasks)


def suite_sources(arguments: str) -> dict[str, str]:
    """The evaluation set of each dataset a `reasoning-gym` suite names, `d1,d2[?size=N]` (N tasks
    each, default `EVALUATION_SIZE`; a single dataset may take config options too), by dataset name."""
    head, sep, query = arguments.partition("?")
    source = f"{SOURCE_PREFIX}{head}?{query}{'&' if sep and query else ''}split=eval"
    spec = ReasoningGymSource.parse(source)
    _check_datasets(spec.datasets, f"reasoning-gym:{arguments}")
    return {name: replace(spec, datasets=(name,)).text() for name in spec.datasets}


def _check_datasets(datasets: Sequence[str], source: str) -> None:
    _reasoning_gym()
    from reasoning_gym.factory import DATASETS

    for name in datasets:
        if name not in DATASETS or name == "composite":
            close = difflib.get_close_matches(name, [n for n in DATASETS if n != "composite"], 3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"{source!r}: reasoning-gym has no dataset {name!r}{hint}")


def _entries(spec: ReasoningGymSource, source: str) -> list[dict[str, Any]]:
    reasoning_gym = _reasoning_gym()
    from reasoning_gym.composite import DatasetSpec

    _check_datasets(spec.datasets, source)
    try:
        if len(spec.datasets) == 1:
            dataset = reasoning_gym.create_dataset(
                spec.datasets[0], size=spec.size, seed=spec.seed, **spec.config
            )
        else:  # each member at the source's own seed, so its entries are those it generates alone
            members = [
                DatasetSpec(name, 1.0, {"seed": spec.seed, "size": spec.size}) for name in spec.datasets
            ]
            dataset = reasoning_gym.create_dataset(
                "composite", size=spec.size, seed=spec.seed, datasets=members
            )
    except (TypeError, ValueError, AssertionError) as error:  # the config's own checks are asserts
        raise ValueError(f"{source!r}: reasoning-gym refuses the config: {error}") from None
    return [dataset[index] for index in range(spec.size)]


def _task(spec: ReasoningGymSource, index: int, entry: dict[str, Any]) -> Task:
    name = str(entry.get("metadata", {}).get("source_dataset") or spec.datasets[0])
    payload = {"dataset": name, "config": dict(spec.config), "entry": entry}
    return Task(
        f"{name}-{spec.seed}-{index}", entry["question"], (str(entry["answer"]),), 0, {METADATA_KEY: payload}
    )


@functools.lru_cache(maxsize=64)
def _scorer(dataset: str, config: str) -> Any:
    return _reasoning_gym().create_dataset(dataset, **json.loads(config)).score_answer


def extract_answer(final_message: str) -> str | None:
    """The answer of a final message as reasoning-gym's own evaluation reads it: the last
    `<answer>...</answer>`, stripped (`reasoning_gym.utils.extract_answer`); None without one."""
    _reasoning_gym()
    from reasoning_gym.utils import extract_answer as extract

    answer: str | None = extract(final_message)
    return answer


def score_answer(task: Task, answer: str) -> float:
    """The dataset's own `score_answer` of `answer` on `task`'s entry, in [0, 1]. A scorer that fails on
    an answer (a model's text can be anything) gives 0, logged."""
    payload = task.metadata.get(METADATA_KEY)
    if not isinstance(payload, Mapping) or "entry" not in payload:
        raise ValueError(
            f"task {task.id!r} holds no reasoning-gym entry (metadata[{METADATA_KEY!r}]): load it from a "
            f"{SOURCE_PREFIX}<dataset> source"
        )
    scorer = _scorer(str(payload["dataset"]), json.dumps(dict(payload.get("config") or {}), sort_keys=True))
    try:
        score = float(scorer(answer, payload["entry"]))
    except Exception as error:  # the dataset's code on model output: a wrong answer, not a crashed run
        log.warning("%s: the %s scorer failed on %r: %r", task.id, payload["dataset"], answer[:200], error)
        return 0.0
    return min(1.0, max(0.0, score))  # reasoning-gym's promise, kept against rounding slips


def reasoning_gym_reward(task: Task, final_message: str, format_weight: float = 0.0) -> Reward:
    """The dataset's score of the final message's `<answer>` (0 without one) as the reward."""
    answer = extract_answer(final_message)
    if answer is None:
        return outcome_reward(0.0, False, format_weight)
    return outcome_reward(score_answer(task, answer), True, format_weight)


class ReasoningGymEnv(ToolEnv):
    """## Description
    reasoning-gym's procedural problems with a sandboxed python interpreter at hand: the model may run
    code before it answers between `<answer>` tags.

    ## Action
    The assistant's message text. Tool calls as Hermes `<tool_call>` JSON or fenced ```python blocks.

    ## Observation
    A tuple of chat messages: the system prompt and the question on reset; one `tool` message per
    call after a step; empty when the episode ends.

    ## Rewards
    The dataset's own `score_answer` of the last `<answer>...</answer>` of the final message (a float in
    [0, 1]; some datasets give partial credit), 0 without one; `format_weight` optionally rewards a
    well-formed wrong answer. Given at termination.

    ## Episode End
    Terminated when a message makes no tool call (the final answer). Truncated after `max_turns`
    messages, `max_tool_calls` calls, `max_context_chars` characters, or a failed call if
    `on_tool_error="truncate"`.

    ## Arguments
    `tasks`: a `reasoning_gym:` source (default `reasoning_gym:basic_arithmetic`), a file of tasks
    written from one (`Task.to_row`), or a list of `Task`s; validation on the training datasets' evaluation
    set (`split=eval`: the reserved seed, 50 tasks); `config`: a `ToolEnvConfig`, whose fields are also
    keyword arguments; `render_mode`: None or "ansi".

    ## Version History
    - v0: first version.
    """

    tool_names = ("python",)
    validation_tasks = f"{DEFAULT_TASKS}?split=eval&size={EVALUATION_SIZE}"
    # One style for every dataset: the answer, in the tags the scorer reads. It teaches the format, not
    # the skill (reasoning-gym has no worked solutions): a pretrained model that never writes `<answer>`
    # scores 0 on every sample, and RL has no signal until it does (docs/real-model.md).
    warm_start_steps = {"answer": 30}  # noqa: RUF012 (a ClassVar of the base)

    def __init__(
        self,
        tasks: str | Sequence[Task] = DEFAULT_TASKS,
        config: ToolEnvConfig | None = None,
        render_mode: str | None = None,
        **config_fields: Any,
    ) -> None:
        tasks = load_tasks(tasks) if isinstance(tasks, str) else tasks
        super().__init__(tasks, config, render_mode, **config_fields)

    @classmethod
    def validation_tasks_for(cls, training_tasks: str | None) -> str | None:
        """The evaluation set of the datasets (and config options) a `reasoning_gym:` source trains on;
        the default set otherwise."""
        if not is_reasoning_gym_source(training_tasks):
            return cls.validation_tasks
        assert training_tasks is not None
        training = ReasoningGymSource.parse(training_tasks)
        if training.split == "eval":
            log.warning(
                "env.tasks %s is an evaluation set: the run trains on what it evaluates on", training_tasks
            )
        return training.evaluation().text()

    def initial_messages(self, task: Task) -> list[Message]:
        return self.pose(SYSTEM_PROMPT, task.question)

    def score(self, task: Task, final_message: str) -> Reward:
        return reasoning_gym_reward(task, final_message, self.config.format_weight)

    def final_answer(self, final_message: str) -> str | None:
        """The answer `score` judges: the last `<answer>`'s content (for maj@k's vote)."""
        return extract_answer(final_message)

    def demonstration(self, task: Task, style: str, rng: random.Random) -> list[Message]:
        """`answer`: the task's answer between `<answer>` tags, with no tool call."""
        if style != "answer":
            raise ValueError(f"{type(self).__name__} writes answer demonstrations, not {style!r}")
        return [{"role": "assistant", "content": f"<answer>{task.answer}</answer>"}]
