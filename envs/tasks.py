"""Tasks: the schema, loaders (JSONL, parquet, Hugging Face datasets), and seeded generators.

Schema of a task file (one JSON object per line, or one parquet row):

    {"id": "mul-00017", "question": "What is 482 * 93?", "answer": "44826", "level": 2, ...}

`answer` is a string or a list of accepted strings (aliases); `level` is optional; any other column
is kept in `Task.metadata`. Rows in verl's RL schema (Search-R1's processed parquet: `prompt`,
`reward_model`, ...) and SkyRL's (`prompt`, `env_class`, `reward_spec`, ...) are read too
(`Task.from_verl_row`). The shipped files in envs/data/ were made by the generators below (`python -m
envs.tasks` rewrites them; the seeds are in `SHIPPED`), the Search world's corpus and questions by
`pacerl.envs.search_world` (`python -m envs.search_world`).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from pacerl.envs.jsonl import read_jsonl, write_jsonl

DATA_DIR = Path(str(resources.files("pacerl.envs").joinpath("data")))


@dataclass(frozen=True)
class Task:
    """One problem an episode poses."""

    id: str
    """Unique within its set."""
    question: str
    """What the user asks."""
    answers: tuple[str, ...]
    """Accepted answers (the first is canonical)."""
    level: int = 0
    """Difficulty, when the generator knows it."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Every other column of the row."""

    @property
    def answer(self) -> str:
        return self.answers[0]

    @classmethod
    def from_row(cls, row: Mapping[str, Any], index: int = 0) -> Task:
        """A task from one file row; a ValueError names the missing or mistyped column. A row in
        verl's RL schema (no `question`, but `prompt` and `reward_model`, or SkyRL's `reward_spec`) is read
        by `from_verl_row`."""
        if "question" not in row and "prompt" in row and ("reward_model" in row or "reward_spec" in row):
            return cls.from_verl_row(row, index)
        if not isinstance(row.get("question"), str) or not row["question"].strip():
            raise ValueError(f"row {index}: 'question' must be a non-empty string")
        answer = row.get("answer", row.get("answers"))
        answers = (answer,) if isinstance(answer, str | int | float) else answer
        if not isinstance(answers, list | tuple) or not answers:
            raise ValueError(f"row {index}: 'answer' must be a string or a non-empty list of strings")
        known = {"id", "question", "answer", "answers", "level"}
        return cls(
            id=str(row.get("id", f"task-{index:05d}")),
            question=row["question"],
            answers=tuple(str(a) for a in answers),
            level=int(row.get("level", 0) or 0),
            metadata={k: v for k, v in row.items() if k not in known},
        )

    @classmethod
    def from_verl_row(cls, row: Mapping[str, Any], index: int = 0) -> Task:
        """A task from a row of verl's RL parquet schema, as Search-R1's data scripts write it
        (`scripts/data_process/nq_search.py`): `data_source`, `prompt` (chat messages), `ability`,
        `reward_model: {"style", "ground_truth"}`, `extra_info: {"split", "index", ...}`; or of SkyRL's
        (skyrl-gym's datasets): `reward_spec: {"method", "ground_truth"}` in place of `reward_model`, and
        `env_class`.

        The answers are `ground_truth["target"]` (Search-R1: a list of accepted answers) or
        `ground_truth` itself (verl's gsm8k/math scripts: one string); the question is
        `extra_info["question"]` when verl put it there, else the last user message. Every column is
        kept in `metadata`, so an env can pose the row's own `prompt` unchanged. The id is
        `<data_source>-<split>-<index>` from `extra_info` (unique across a merged test file)."""
        messages = _messages(row["prompt"], index)
        reward_model = row["reward_model"] if "reward_model" in row else row["reward_spec"]
        truth = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
        target = truth.get("target") if isinstance(truth, Mapping) else truth
        if isinstance(target, str | int | float):
            answers: tuple[str, ...] = (str(target),)
        elif isinstance(target, Iterable) and not isinstance(target, Mapping):
            answers = tuple(str(answer) for answer in target)
        else:
            answers = ()
        if not answers:
            raise ValueError(
                f"row {index}: reward_model.ground_truth (or reward_spec.ground_truth) must be an answer, a "
                "list of answers or {'target': [answers]}"
            )
        extra = row.get("extra_info")
        extra = extra if isinstance(extra, Mapping) else {}
        users = [m["content"] for m in messages if m["role"] == "user"]
        question = extra.get("question") if isinstance(extra.get("question"), str) else None
        question = question or (users[-1] if users else "")
        if not question.strip():
            raise ValueError(f"row {index}: the prompt holds no user message")
        source = str(row.get("data_source") or "verl")
        number = extra.get("index", index)
        task_id = f"{source}-{extra['split']}-{number}" if "split" in extra else f"{source}-{number}"
        metadata = {key: value for key, value in row.items() if key != "prompt"}
        return cls(id=task_id, question=question, answers=answers, metadata={**metadata, "prompt": messages})

    def to_row(self) -> dict[str, Any]:
        answer: str | list[str] = self.answers[0] if len(self.answers) == 1 else list(self.answers)
        return {
            "id": self.id,
            "question": self.question,
            "answer": answer,
            "level": self.level,
            **self.metadata,
        }


def _messages(prompt: Any, index: int) -> list[dict[str, str]]:
    """The chat messages of a verl row's `prompt` (a list of `{"role", "content"}`; pandas hands
    over a numpy array of them)."""
    items = list(prompt) if isinstance(prompt, Iterable) and not isinstance(prompt, str | Mapping) else []
    messages = [
        {"role": str(item["role"]), "content": str(item["content"])}
        for item in items
        if isinstance(item, Mapping) and "role" in item and "content" in item
    ]
    if not messages or len(messages) != len(items):
        raise ValueError(f"row {index}: 'prompt' must be a list of {{'role', 'content'}} messages")
    return messages


def load_tasks(source: str | Path, split: str = "train") -> list[Task]:
    """Tasks from a .jsonl or .parquet file, a shipped set's name (e.g. `codemath-val`), or a Hugging
    Face dataset name (needs the `datasets` package and a reachable hub, or a local dataset path); a
    `bfcl:` name is a BFCL multi-turn set from bfcl-eval (`pacerl.envs.bfcl_backends.named_bfcl_tasks`); a
    `reasoning_gym:<dataset>[,<dataset>...][?size=N&seed=S&...]` source generates reasoning-gym's tasks
    (`pacerl.envs.reasoning_gym`)."""
    if str(source).startswith("bfcl:"):
        from pacerl.envs.bfcl_backends import named_bfcl_tasks  # imported late: bfcl-eval is optional

        return named_bfcl_tasks(str(source))
    if str(source).startswith("reasoning_gym:"):
        from pacerl.envs.reasoning_gym import reasoning_gym_tasks  # imported late: reasoning-gym is optional

        return reasoning_gym_tasks(str(source))
    path = Path(source)
    shipped = DATA_DIR / f"{source}.jsonl"
    if not path.exists() and shipped.exists():
        path = shipped
    if path.suffix in (".jsonl", ".parquet") or (path.exists() and path.suffix == ".json"):
        try:
            stat = path.stat()
        except FileNotFoundError:
            raise ValueError(f"{path}: no such task file") from None
        return list(_read_task_file(path.resolve(), stat.st_mtime_ns, stat.st_size))
    if path.exists() and path.is_file():
        raise ValueError(f"{path}: task files must be .jsonl or .parquet")
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{source!r} is no task file or shipped set, and `datasets` is not installed"
        ) from None
    return _from_rows(datasets.load_dataset(str(source), split=split))


def hold_out(
    tasks: Sequence[Task], seed: int, share: float = 0.1, most: int = 64
) -> tuple[list[Task], list[Task]]:
    """(the tasks to train on, the tasks held out of training to evaluate on) for an env that ships no
    validation set: `share` of the tasks (at least 1, at most `most`), chosen by `seed`, each list in
    the tasks' own order. The same tasks and seed hold out the same tasks, so `pacerl eval` scores a run
    on the very tasks its training never drew. A ValueError for fewer than 2 tasks."""
    if len(tasks) < 2:
        raise ValueError(f"holding tasks out of training needs at least 2 tasks, got {len(tasks)}")
    count = min(most, max(1, int(len(tasks) * share)), len(tasks) - 1)
    held = set(random.Random(seed).sample(range(len(tasks)), count))
    kept = [task for index, task in enumerate(tasks) if index not in held]
    return kept, [task for index, task in enumerate(tasks) if index in held]


@functools.lru_cache(maxsize=32)
def _read_task_file(path: Path, mtime_ns: int, size: int) -> tuple[Task, ...]:
    """The tasks of one file, cached by path, modification time and size: every env of a run (one per
    episode) reads its task file, and parsing 2,000 rows each time cost more than the episode."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return tuple(_from_rows(pq.read_table(path).to_pylist()))
    return tuple(_from_rows(row for _, row in read_jsonl(path)))


def _from_rows(rows: Iterable[Mapping[str, Any]]) -> list[Task]:
    tasks = [Task.from_row(row, index) for index, row in enumerate(rows)]
    if not tasks:
        raise ValueError("the task set is empty")
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError("task ids must be unique")
    return tasks


# -- generators -----------------------------------------------------------------------------------------


def arithmetic_tasks(
    count: int, seed: int, levels: Sequence[int] = (1, 2, 3), prefix: str = "arith"
) -> list[Task]:
    """Problems a single python call solves exactly and a small model cannot do in its head.

    Level 1: A*B with 2-digit operands; 2: A*B with 2-3 digits; 3: A+B*C with 2-3 digits;
    4: A*B-C*D with 3-4 digits.
    """
    rng = random.Random(seed)
    tasks = []
    for index in range(count):
        level = rng.choice(list(levels))
        digits = {1: (2, 2), 2: (2, 3), 3: (2, 3), 4: (3, 4)}[level]

        def number(rng: random.Random = rng, digits: tuple[int, int] = digits) -> int:
            width = rng.randint(*digits)
            return rng.randint(10 ** (width - 1), 10**width - 1)

        if level <= 2:
            a, b = number(), number()
            expression, value = f"{a} * {b}", a * b
        elif level == 3:
            a, b, c = number(), number(), number()
            expression, value = f"{a} + {b} * {c}", a + b * c
        else:
            a, b, c, d = number(), number(), number(), number()
            expression, value = f"{a} * {b} - {c} * {d}", a * b - c * d
        tasks.append(Task(f"{prefix}-{index:05d}", f"What is {expression}?", (str(value),), level))
    return tasks


# The CodeMath generator: the same arithmetic in many surface forms. A form is a wording (how the question
# is asked) crossed with a notation (how the arithmetic is written); a fixed set of (wording, notation)
# pairs is held out of training, each wording and each notation exactly once, so every held-out question
# is written with pieces training showed, but combined in a way it never did.

CODEMATH_WORDINGS: dict[str, str] = {
    "what-is": "What is {e}?",
    "compute": "Compute {e}.",
    "calculate": "Calculate {e}",
    "equals": "{e} = ?",
    "evaluate": "Evaluate {e}.",
    "value-of": "Find the value of {e}.",
}
"""How a question is asked; `{e}` is the arithmetic in the form's notation."""
CODEMATH_NOTATIONS = ("spaced", "tight", "cross", "words", "let", "sum")
"""How the arithmetic is written: `12 * (-34) + 5`, `12*(-34)+5`, `12 × (-34) + 5`, `12 times -34 plus 5`;
`let`: two steps with a variable (`Let x = 12 * 34. What is x - 5 * 67?`), solved by a small program;
`sum`: the sum of a list of 3-6 numbers."""
CODEMATH_FORMS = tuple(f"{w}/{n}" for w in CODEMATH_WORDINGS for n in CODEMATH_NOTATIONS)
"""Every form, `wording/notation`."""
HELDOUT_FORMS = (
    "what-is/words",
    "compute/let",
    "calculate/cross",
    "equals/sum",
    "evaluate/tight",
    "value-of/spaced",
)
"""The forms no training set holds (`codemath-heldout` is made of them)."""
TRAINING_FORMS = tuple(form for form in CODEMATH_FORMS if form not in HELDOUT_FORMS)

_WORDS = {"*": "times", "+": "plus", "-": "minus"}
_SHAPES = {  # the shape of a single-step expression: operands (None) and operators
    "mul": (None, "*", None),
    "add-mul": (None, "+", None, "*", None),
    "mul-sub": (None, "*", None, "-", None),
    "paren": ("(", None, "+", None, ")", "*", None),
}


def codemath_tasks(count: int, seed: int, forms: Sequence[str], prefix: str = "codemath") -> list[Task]:
    """`count` CodeMath problems in `forms` (drawn uniformly; names from `CODEMATH_FORMS`), each tagged
    with its form and the program that solves it (`metadata["form"]`, `metadata["code"]`: what a
    demonstration runs). Operands have 2-4 digits (a quarter of the single-step problems has one
    negative operand); `let` problems take two steps through a variable, `sum` problems add 3-6
    numbers. `level` counts the operations. Deterministic per seed."""
    unknown = sorted(set(forms) - set(CODEMATH_FORMS))
    if unknown or not forms:
        raise ValueError(f"unknown CodeMath forms {unknown} (known: {', '.join(CODEMATH_FORMS)})")
    rng = random.Random(seed)
    tasks = []
    for index in range(count):
        form = rng.choice(list(forms))
        wording, notation = form.split("/")
        setup, phrase, code, value, level = _codemath_problem(rng, notation)
        asked = CODEMATH_WORDINGS[wording].format(e=phrase)
        question = setup + (asked[0].upper() + asked[1:] if asked.startswith("the ") else asked)
        metadata = {"form": form, "code": code}
        tasks.append(Task(f"{prefix}-{index:05d}", question, (str(value),), level, metadata))
    return tasks


def _operand(rng: random.Random, widths: Sequence[int] = (2, 2, 3, 3, 4)) -> int:
    width = rng.choice(list(widths))
    return rng.randint(10 ** (width - 1), 10**width - 1)


def _codemath_problem(rng: random.Random, notation: str) -> tuple[str, str, str, int, int]:
    """(a first step the question states, or "", the arithmetic it asks for, as it writes it, a program
    printing the answer, the answer, the level)."""
    if notation == "sum":
        numbers = [_operand(rng, (1, 2, 3)) for _ in range(rng.randint(3, 6))]
        listed = ", ".join(str(n) for n in numbers[:-1]) + f" and {numbers[-1]}"
        return "", f"the sum of {listed}", f"print(sum([{', '.join(map(str, numbers))}]))", sum(numbers), 2
    if notation == "let":
        name = rng.choice("xyn")
        a, b, c, d = (_operand(rng, (2, 3)) for _ in range(4))
        op = rng.choice("+-")
        first, second = f"{a} * {b}", f"{c} * {d}"
        value = a * b + c * d if op == "+" else a * b - c * d
        code = f"{name} = {first}\nprint({name} {op} {second})"
        return f"Let {name} = {first}. ", f"{name} {op} {second}", code, value, 3
    shape = _SHAPES[rng.choice(list(_SHAPES))]
    slots = [i for i, part in enumerate(shape) if part is None]
    operands = {i: _operand(rng) for i in slots}
    if rng.random() < 0.25:
        negative = rng.choice(slots)
        operands[negative] = -operands[negative]
    parts = [str(operands[i]) if part is None else part for i, part in enumerate(shape)]
    symbolic = " ".join(parts).replace("( ", "(").replace(" )", ")")
    value = _arithmetic(parts)
    level = sum(part in _WORDS for part in parts)
    if notation == "words":
        phrase = " ".join(_WORDS.get(part, part) for part in parts).replace("( ", "(").replace(" )", ")")
        code_expression = symbolic
    else:
        # A negative operand after an operator is written in parentheses, as people write it.
        parts = [f"({p})" if p[0] == "-" and parts[i - 1] in _WORDS else p for i, p in enumerate(parts)]
        code_expression = " ".join(parts).replace("( ", "(").replace(" )", ")")
        if notation == "tight":
            code_expression = code_expression.replace(" ", "")
        phrase = code_expression.replace("*", "×") if notation == "cross" else code_expression
    return "", phrase, f"print({code_expression})", value, level


def _arithmetic(parts: Sequence[str]) -> int:
    """The value of `parts` (integers, + - * and parentheses) with the usual precedence."""
    tokens = list(parts)

    def expression(position: int) -> tuple[int, int]:
        total, position = term(position)
        while position < len(tokens) and tokens[position] in "+-":
            sign = 1 if tokens[position] == "+" else -1
            right, position = term(position + 1)
            total += sign * right
        return total, position

    def term(position: int) -> tuple[int, int]:
        product, position = factor(position)
        while position < len(tokens) and tokens[position] == "*":
            right, position = factor(position + 1)
            product *= right
        return product, position

    def factor(position: int) -> tuple[int, int]:
        if tokens[position] == "(":
            inner, position = expression(position + 1)
            return inner, position + 1
        return int(tokens[position]), position + 1

    value, end = expression(0)
    if end != len(tokens):
        raise ValueError(f"not an expression: {' '.join(parts)}")
    return value


@dataclass(frozen=True)
class ArithmeticSet:
    """A shipped arithmetic task file: how many, which seed, which levels."""

    count: int
    seed: int
    levels: tuple[int, ...]


@dataclass(frozen=True)
class CodeMathSet:
    """A shipped CodeMath task file in varied surface forms: how many, which seed, which forms."""

    count: int
    seed: int
    forms: tuple[str, ...]


SHIPPED: dict[str, ArithmeticSet | CodeMathSet] = {
    "codemath-train": ArithmeticSet(2000, seed=1, levels=(1, 2, 3)),
    "codemath-val": ArithmeticSet(200, seed=2, levels=(1, 2, 3)),
    "codemath-forms-train": CodeMathSet(2000, seed=1, forms=TRAINING_FORMS),
    "codemath-heldout": CodeMathSet(200, seed=7, forms=HELDOUT_FORMS),
    "math-train": ArithmeticSet(2000, seed=3, levels=(1,)),
    "math-val": ArithmeticSet(200, seed=4, levels=(1,)),
}
"""How each shipped task file in envs/data/ was made (the Search world's files:
`pacerl.envs.search_world`)."""


def write_shipped(directory: Path = DATA_DIR) -> None:
    """Regenerate every shipped file (deterministic)."""
    for name, spec in SHIPPED.items():
        if isinstance(spec, ArithmeticSet):
            tasks = arithmetic_tasks(spec.count, spec.seed, spec.levels, prefix=name)
            write_jsonl(directory / f"{name}.jsonl", (t.to_row() for t in tasks))
        else:
            tasks = codemath_tasks(spec.count, spec.seed, spec.forms, prefix=name)
            write_jsonl(directory / f"{name}.jsonl", (t.to_row() for t in tasks))


if __name__ == "__main__":
    write_shipped()
    print(f"wrote the shipped task sets to {DATA_DIR}")
