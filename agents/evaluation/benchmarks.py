"""Named benchmarks and suites: the datasets papers report, each with its loader, its field mapping to
`Task`, the env that scores it and the sampling papers use.

    tasks = load_benchmark("gsm8k")  # datasets.load_dataset("openai/gsm8k", "main", split="test")
    tasks = load_benchmark("gsm8k", data_files="gsm8k.parquet")  # the same schema, a local file
    tasks = load_benchmark("gsm8k", mirror="~/bench")  # ~/bench/gsm8k.parquet ($PACERL_BENCHMARK_DIR)
    suite_benchmarks("math")  # aime24, aime25, math500, gsm8k

Every load goes through `datasets` (a local file through its `parquet`/`json` builders), so a local copy
is read exactly as the hub's. Without a local copy and without the hub (offline: `HF_HUB_OFFLINE=1`
fails at once instead of retrying) the error is a ValueError naming the benchmark, the dataset and what
to pass.

Sources, names and schemas, as checked on the dataset cards and in the evaluators that load them:

- aime24: `HuggingFaceH4/aime_2024`, default config, split `train`, 30 rows; `id` int64, `problem`,
  `answer` (string), `solution`, `url`, `year` (lighteval's `aime24` task).
- aime25: `opencompass/AIME2025`, configs `AIME2025-I` and `AIME2025-II`, split `test`, 15 rows each;
  `question`, `answer` (evalscope's and verifiers' `aime2025`).
- math500: `HuggingFaceH4/MATH-500`, split `test`, 500 rows; `problem`, `solution`, `answer` (LaTeX),
  `subject`, `level` int64, `unique_id` (Lightman et al.'s split; lighteval's `math_500`).
- gsm8k: `openai/gsm8k`, config `main`, split `test`, 1,319 rows; `question`, `answer` (a worked
  solution ending in `#### N`) (lm-evaluation-harness' `gsm8k`; verl's `gsm8k.py`).
- nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa, musique, bamboogle: `RUC-NLPIR/FlashRAG_datasets`,
  config = the name; `id`, `question`, `golden_answers` (list of strings), `metadata`. Split `test`
  where the set has one, else `dev` (hotpotqa, 2wikimultihopqa, musique): Search-R1's rule in its
  `scripts/data_process/qa_search_test_merge.py`, which loads the same dataset.

The QA benchmarks also read Search-R1's own processed parquet (`data_source`, `prompt`, `ability`,
`reward_model.ground_truth.target`, `extra_info`; its `test.parquet` merges the seven sets): given as
`data_files`, its rows of `data_source == name` are taken and posed with their own prompt.

Default sampling (`Benchmark.eval_settings`, `EvalConfig` fields): AIME avg@32 at temperature 0.6
(DeepSeek-R1's protocol; pass@1 and pass@32 reported), MATH-500 avg@4 at 0.6, GSM8K greedy, the QA
sets greedy exact match with Search-R1's limits (500 new tokens a turn, 4,096 in all, each turn cut at
`</search>`/`</answer>`). The math sets' token budgets are the model's business (the caller's config).

BFCL v4 multi-turn (`bfcl-multi-turn`: multi_turn_base, multi_turn_miss_func, multi_turn_miss_param,
multi_turn_long_context, 200 entries each) is shipped by the `bfcl-eval` package (`pip install --no-deps
bfcl-eval==2026.3.23`): nothing to download or mirror. Greedy, 2,048 new tokens a message, 32,768 tokens
an episode (65,536 for long_context), the tool schemas in the prompt; scored by
`pacerl/BFCL-MultiTurn-v0` with BFCL's multi-turn checks. The suite's `Avg.` is BFCL's "Multi Turn
Overall Acc": the unweighted mean of the four categories (its `calculate_unweighted_accuracy`).

BFCL v4's single-turn AST categories (`bfcl`: simple_python 400 entries, multiple, parallel,
parallel_multiple 200 each, irrelevance 240), shipped by bfcl-eval too: greedy, 2,048 new tokens, the
entry's functions as the prompt's tools; scored by `pacerl/BFCL-AST-v0` with BFCL's AST match. The
suite's `Avg.` (the mean of the five columns) is not a BFCL figure: BFCL's "Non-Live AST" is the
unweighted mean of simple, multiple, parallel and parallel_multiple, its simple being the mean of
simple_python, simple_java and simple_javascript (not in this suite), and it reports irrelevance apart.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pacerl.envs.bfcl_backends import named_bfcl_tasks
from pacerl.envs.reasoning_gym import suite_sources
from pacerl.envs.search import SEARCH_R1_STOP, search_r1_question
from pacerl.envs.tasks import Task, load_tasks

MIRROR_ENV = "PACERL_BENCHMARK_DIR"
"""Environment variable naming a local mirror directory: `<dir>/<benchmark>.parquet` (or `.jsonl`,
`.json`, or a directory `<dir>/<benchmark>/` of such files or a `save_to_disk` copy)."""

_SUFFIXES = (".parquet", ".jsonl", ".json")

LIBRARY_LOCAL_COPY = (
    "data_files=FILE (.parquet/.jsonl), or a mirror directory holding {name}.parquet (mirror=DIR, or "
    f"{MIRROR_ENV}=DIR)"
)
"""How a caller of `load_benchmark` gives a local copy (`{name}`: the benchmark)."""
SEARCH_R1_MERGED = "test.parquet"
"""The name of Search-R1's merged test file (`qa_search_test_merge.py`), which a mirror may hold for all
seven QA benchmarks at once."""


@dataclass(frozen=True)
class Benchmark:
    """One named benchmark: where its data lives, how a row becomes a `Task`, what scores it."""

    name: str
    """The name a suite and `load_benchmark` use (`aime24`)."""
    title: str
    """Its column header in a results table (`AIME24`)."""
    dataset: str
    """The Hugging Face dataset name (`HuggingFaceH4/aime_2024`)."""
    configs: tuple[str | None, ...]
    """Its configs, loaded in turn and concatenated (None: the default config)."""
    split: str
    """The split evaluated."""
    to_task: Callable[[Mapping[str, Any], int], Task]
    """The field mapping: a dataset row and its index to a `Task`."""
    env_id: str
    """The env that poses and scores it (any env can be asked instead)."""
    eval_settings: Mapping[str, Any] = field(default_factory=dict)
    """`EvalConfig` fields as papers report this benchmark (samples, temperature, ...)."""
    env_settings: Mapping[str, Any] = field(default_factory=dict)
    """Settings of its env (`ToolEnvConfig.settings`) that pose it as papers do (the math sets:
    `{"prompt": "paper"}`, Math-v0's `PAPER_INSTRUCTION` after the problem)."""
    shipped: Callable[[], list[Task]] | None = None
    """Its tasks when an installed package ships them (BFCL's data in bfcl-eval, reasoning-gym's
    generators): nothing to download or mirror, so `dataset`, `configs`, `split` and `to_task` are
    only descriptive and `data_files`/`mirror` are not consulted."""


def _rest(row: Mapping[str, Any], *used: str) -> dict[str, Any]:
    return {key: value for key, value in row.items() if key not in used}


def _text(row: Mapping[str, Any], column: str, index: int) -> str:
    value = row.get(column)
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"row {index}: column {column!r} must be a non-empty string, got {value!r}")
    return value.strip()


def aime24_task(row: Mapping[str, Any], index: int) -> Task:
    """HuggingFaceH4/aime_2024: `problem`, `answer` (an integer as a string), `id`."""
    answer = _text(row, "answer", index)
    return Task(
        f"aime24-{row.get('id', index)}",
        _text(row, "problem", index),
        (answer,),
        0,
        _rest(row, "problem", "answer"),
    )


def aime25_task(row: Mapping[str, Any], index: int) -> Task:
    """opencompass/AIME2025: `question`, `answer`; ids number the 30 problems (I then II)."""
    answer = _text(row, "answer", index)
    return Task(
        f"aime25-{index:02d}", _text(row, "question", index), (answer,), 0, _rest(row, "question", "answer")
    )


def math500_task(row: Mapping[str, Any], index: int) -> Task:
    """HuggingFaceH4/MATH-500: `problem`, `answer` (LaTeX, checked by math-verify), `level`, `unique_id`."""
    level = row.get("level")
    return Task(
        str(row.get("unique_id") or f"math500-{index:03d}"),
        _text(row, "problem", index),
        (_text(row, "answer", index),),
        int(level) if isinstance(level, int) else 0,
        _rest(row, "problem", "answer", "level", "unique_id"),
    )


def gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K solution: the number after `####`, thousands separators removed."""
    _, marker, tail = solution.rpartition("####")
    if not marker or not tail.strip():
        raise ValueError(f"a GSM8K answer ends in '#### N'; got {solution[-80:]!r}")
    return tail.strip().replace(",", "")


def gsm8k_task(row: Mapping[str, Any], index: int) -> Task:
    """openai/gsm8k: `question`, `answer` (the worked solution ending in `#### N`, kept as `solution`)."""
    solution = _text(row, "answer", index)
    metadata = {**_rest(row, "question", "answer"), "solution": solution}
    return Task(f"gsm8k-{index:04d}", _text(row, "question", index), (gsm8k_answer(solution),), 0, metadata)


def qa_task(name: str) -> Callable[[Mapping[str, Any], int], Task]:
    """FlashRAG's QA rows (`id`, `question`, `golden_answers`) of benchmark `name`, or rows of
    Search-R1's processed parquet (posed with their own prompt; the question read back out of it)."""

    def to_task(row: Mapping[str, Any], index: int) -> Task:
        if "golden_answers" not in row and "reward_model" in row:
            task = Task.from_verl_row(row, index)
            question = search_r1_question(task.question) or task.question
            return Task(task.id, question.strip(), task.answers, 0, task.metadata)
        answers = row.get("golden_answers")
        if isinstance(answers, str) or not isinstance(answers, Sequence) or not answers:
            raise ValueError(f"row {index}: 'golden_answers' must be a non-empty list of strings")
        task_id = f"{name}-{row.get('id', index)}"
        metadata = _rest(row, "id", "question", "golden_answers")
        return Task(task_id, _text(row, "question", index), tuple(str(a) for a in answers), 0, metadata)

    return to_task


_SAMPLED_MATH = {"temperature": 0.6}
_PAPER_MATH_PROMPT = {"prompt": "paper"}
_SEARCH_R1_EVAL = {
    "samples": 1,
    "temperature": 0.0,
    "stop_strings": SEARCH_R1_STOP,
    "max_new_tokens": 500,
    "max_total_tokens": 4096,
}
_FLASHRAG = "RUC-NLPIR/FlashRAG_datasets"
_QA_SPLITS = {
    "nq": ("NQ", "test"),
    "triviaqa": ("TriviaQA", "test"),
    "popqa": ("PopQA", "test"),
    "hotpotqa": ("HotpotQA", "dev"),
    "2wikimultihopqa": ("2Wiki", "dev"),
    "musique": ("Musique", "dev"),
    "bamboogle": ("Bamboogle", "test"),
}

_BFCL_EVAL = {"samples": 1, "temperature": 0.0, "max_new_tokens": 2048, "tool_schemas_in_prompt": True}
_BFCL_CATEGORIES = {  # BFCL's multi-turn columns and each category's context budget
    "multi_turn_base": ("Base", 32_768),
    "multi_turn_miss_func": ("Miss Func", 32_768),
    "multi_turn_miss_param": ("Miss Param", 32_768),
    "multi_turn_long_context": ("Long Context", 65_536),
}


_BFCL_AST_CATEGORIES = {  # BFCL's non-live single-turn Python columns
    "simple_python": "Simple Python",
    "multiple": "Multiple",
    "parallel": "Parallel",
    "parallel_multiple": "Parallel Multiple",
    "irrelevance": "Irrelevance",
}


def _bfcl_loader(category: str) -> Callable[[], list[Task]]:
    def load() -> list[Task]:
        return named_bfcl_tasks(f"bfcl:{category}")

    return load


BENCHMARKS: dict[str, Benchmark] = {
    "aime24": Benchmark(
        "aime24", "AIME24", "HuggingFaceH4/aime_2024", (None,), "train", aime24_task, "pacerl/Math-v0",
        {"samples": 32, **_SAMPLED_MATH}, _PAPER_MATH_PROMPT,
    ),
    "aime25": Benchmark(
        "aime25", "AIME25", "opencompass/AIME2025", ("AIME2025-I", "AIME2025-II"), "test", aime25_task,
        "pacerl/Math-v0", {"samples": 32, **_SAMPLED_MATH}, _PAPER_MATH_PROMPT,
    ),
    "math500": Benchmark(
        "math500", "MATH-500", "HuggingFaceH4/MATH-500", (None,), "test", math500_task, "pacerl/Math-v0",
        {"samples": 4, **_SAMPLED_MATH}, _PAPER_MATH_PROMPT,
    ),
    "gsm8k": Benchmark(
        "gsm8k", "GSM8K", "openai/gsm8k", ("main",), "test", gsm8k_task, "pacerl/Math-v0",
        {"samples": 1, "temperature": 0.0}, _PAPER_MATH_PROMPT,
    ),
    **{
        name: Benchmark(
            name, title, _FLASHRAG, (name,), split, qa_task(name), "pacerl/SearchR1-v0", _SEARCH_R1_EVAL
        )
        for name, (title, split) in _QA_SPLITS.items()
    },
    **{
        name: Benchmark(
            name, title, "bfcl-eval", (f"BFCL_v4_{name}.json",), "test", Task.from_row,
            "pacerl/BFCL-MultiTurn-v0", {**_BFCL_EVAL, "max_total_tokens": budget},
            shipped=_bfcl_loader(name),
        )
        for name, (title, budget) in _BFCL_CATEGORIES.items()
    },
    **{
        name: Benchmark(
            name, title, "bfcl-eval", (f"BFCL_v4_{name}.json",), "test", Task.from_row, "pacerl/BFCL-AST-v0",
            _BFCL_EVAL, shipped=_bfcl_loader(name),
        )
        for name, title in _BFCL_AST_CATEGORIES.items()
    },
}  # fmt: skip
"""Every named benchmark."""

SUITES: dict[str, tuple[str, ...]] = {
    "math": ("aime24", "aime25", "math500", "gsm8k"),
    "aime": ("aime24", "aime25"),
    "search-r1": ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"),
    "nq-hotpotqa": ("nq", "hotpotqa"),
    "bfcl-multi-turn": tuple(_BFCL_CATEGORIES),
    "bfcl": tuple(_BFCL_AST_CATEGORIES),
}
"""Named suites, in the column order of the papers' tables (`search-r1`: Search-R1's Table 2)."""


SUITE_FAMILIES: dict[str, Callable[[str], tuple[Benchmark, ...]]] = {}
"""Suites named with arguments, `family:arguments` (`reasoning-gym:basic_arithmetic,leg_counting`): the
family's function builds the benchmarks from the arguments; a module registers its family at import."""


def reasoning_gym_benchmarks(arguments: str) -> tuple[Benchmark, ...]:
    """The `reasoning-gym` family, `reasoning-gym:d1,d2[?size=N]`: one benchmark per reasoning-gym
    dataset, its N tasks (default 50) generated at the seed reserved for evaluation (never a training
    one: `pacerl.envs.reasoning_gym`), scored greedily in pacerl/ReasoningGym-v0 by the dataset's own
    `score_answer`."""
    return tuple(
        Benchmark(
            name, name, source, (None,), "eval", Task.from_row, "pacerl/ReasoningGym-v0",
            {"samples": 1, "temperature": 0.0}, shipped=functools.partial(load_tasks, source),
        )
        for name, source in suite_sources(arguments).items()
    )  # fmt: skip


SUITE_FAMILIES["reasoning-gym"] = reasoning_gym_benchmarks


def bfcl_part_benchmarks(part: str) -> tuple[Benchmark, ...]:
    """The `bfcl-multi-turn` family, `bfcl-multi-turn:eval` (or `:train`): BFCL's four multi-turn columns
    on one side of the env's split (`bfcl_split`), so that a model trained on `bfcl:multi_turn/train`
    (BFCL-MultiTurn-v0's default) is scored on entries it never saw; the plain `bfcl-multi-turn` suite
    scores all 800, as the leaderboard does."""
    if part not in ("train", "eval"):
        raise ValueError(f"bfcl-multi-turn:{part}: the part is train or eval")

    def benchmark(name: str) -> Benchmark:
        return replace(BENCHMARKS[name], shipped=lambda: named_bfcl_tasks(f"bfcl:{name}/{part}"))

    return tuple(benchmark(name) for name in _BFCL_CATEGORIES)


SUITE_FAMILIES["bfcl-multi-turn"] = bfcl_part_benchmarks


def get_benchmark(benchmark: str | Benchmark) -> Benchmark:
    """A benchmark by name (or itself); a ValueError lists the names."""
    if isinstance(benchmark, Benchmark):
        return benchmark
    if benchmark not in BENCHMARKS:
        raise ValueError(f"no benchmark named {benchmark!r}; benchmarks: {', '.join(BENCHMARKS)}")
    return BENCHMARKS[benchmark]


def suite_benchmarks(name: str) -> tuple[Benchmark, ...]:
    """The benchmarks of suite `name`; a benchmark's own name is a suite of one; `family:arguments` asks
    a family of `SUITE_FAMILIES` to build them."""
    family, sep, arguments = name.partition(":")
    if sep:
        if family not in SUITE_FAMILIES:
            raise ValueError(
                f"no suite family {family!r} (in {name!r}); families: {', '.join(SUITE_FAMILIES)}"
            )
        return SUITE_FAMILIES[family](arguments)
    if name in SUITES:
        return tuple(BENCHMARKS[member] for member in SUITES[name])
    if name in BENCHMARKS:
        return (BENCHMARKS[name],)
    raise ValueError(
        f"no suite or benchmark named {name!r}; suites: {', '.join(SUITES)}; "
        f"benchmarks: {', '.join(BENCHMARKS)}"
    )


def load_benchmark(
    benchmark: str | Benchmark,
    *,
    data_files: str | Path | Sequence[str | Path] | None = None,
    mirror: str | Path | None = None,
    local_copy: str = LIBRARY_LOCAL_COPY,
) -> list[Task]:
    """The tasks of `benchmark`: from `data_files` (files in its hub schema, or Search-R1's processed
    parquet), else from `mirror` (or the `PACERL_BENCHMARK_DIR` directory), else from the hub with
    `datasets.load_dataset(dataset, config, split=split)`. A ValueError names what failed and what to
    pass (`local_copy`: how the caller's user gives a local copy, `{name}` the benchmark's name; the
    command line names its flag); a mirror that lacks the benchmark is an error, not a silent trip to
    the hub."""
    bench = get_benchmark(benchmark)
    if bench.shipped is not None:
        return bench.shipped()
    mirror = mirror if mirror is not None else os.environ.get(MIRROR_ENV) or None
    if data_files is not None:
        rows = _local_rows(bench, data_files)
    elif mirror is not None:
        rows = _local_rows(bench, _mirror_entry(bench, Path(mirror).expanduser()))
    else:
        rows = _hub_rows(bench, local_copy)
    if rows and "data_source" in rows[0] and "reward_model" in rows[0]:  # Search-R1's merged files
        rows = [row for row in rows if row.get("data_source") == bench.name]
    if not rows:
        raise ValueError(f"benchmark {bench.name!r}: the data holds no rows (of data_source {bench.name!r})")
    tasks = [bench.to_task(row, index) for index, row in enumerate(rows)]
    if len({task.id for task in tasks}) != len(tasks):
        raise ValueError(f"benchmark {bench.name!r}: task ids are not unique")
    return tasks


def _mirror_entry(bench: Benchmark, mirror: Path) -> Path | list[Path]:
    """What a mirror holds of `bench`: `<mirror>/<name>` (a file, a `save_to_disk` copy, or a hub
    snapshot narrowed to the benchmark's own configs and split: the files its dataset card maps them
    to, else its config directories, `gsm8k/main/test-*.parquet`), else, for a Search-R1 benchmark,
    Search-R1's merged `<mirror>/test.parquet` (its `data_source` column picks the benchmark's rows)."""
    candidates = [mirror / bench.name, *(mirror / f"{bench.name}{suffix}" for suffix in _SUFFIXES)]
    for candidate in candidates:
        if candidate.is_dir() and not (candidate / "dataset_info.json").exists():
            card = _card_files(bench, candidate)
            return card if card is not None else _config_dirs(bench, candidate)
        if candidate.exists():
            return candidate
    merged = mirror / SEARCH_R1_MERGED
    if bench.env_id == "pacerl/SearchR1-v0" and merged.is_file() and _has_column(merged, "data_source"):
        return merged
    looked = ", ".join(str(c) for c in candidates)
    raise ValueError(f"benchmark {bench.name!r}: the mirror {mirror} holds none of {looked}")


def _card_files(bench: Benchmark, directory: Path) -> list[Path] | None:
    """The files a hub snapshot's dataset card maps the benchmark's configs and split to (README.md's
    YAML header: `configs`, each a `config_name` with `data_files` of `{split, path}`, the default
    config marked `default: true` or named `default`), in the benchmark's config order; None when the
    snapshot has no such card. A config or split the card does not map is an error."""
    card = directory / "README.md"
    text = card.read_text(encoding="utf-8") if card.is_file() else ""
    if not text.startswith("---"):
        return None
    import yaml  # a dependency of `datasets`, which reads the files

    header = yaml.safe_load(text.split("---", 2)[1]) or {}
    listed = header.get("configs") if isinstance(header, dict) else None
    configs = {c.get("config_name"): c for c in listed or [] if isinstance(c, dict)}
    if not configs:
        return None
    files: list[Path] = []
    for name in bench.configs:
        default = next((c for c in configs.values() if c.get("default")), configs.get("default"))
        entry = configs.get(name) if name is not None else default
        if entry is None:
            raise ValueError(
                f"benchmark {bench.name!r}: the dataset card of {directory} maps no config "
                f"{name or 'default'!r} (it maps {sorted(map(str, configs))})"
            )
        specs = entry.get("data_files")
        specs = specs if isinstance(specs, list) else []
        paths = [s.get("path") for s in specs if isinstance(s, dict) and s.get("split") == bench.split]
        patterns = [p for path in paths for p in (path if isinstance(path, list) else [path])]
        found = sorted({f for pattern in patterns for f in directory.glob(str(pattern)) if f.is_file()})
        if not found:
            raise ValueError(
                f"benchmark {bench.name!r}: the dataset card of {directory} maps no existing "
                f"{bench.split!r} files to config {name or 'default'!r} (patterns {patterns})"
            )
        files += found
    return files


def _config_dirs(bench: Benchmark, directory: Path) -> Path | list[Path]:
    """A hub snapshot's directories of the benchmark's named configs (`main` of gsm8k, not `socratic`),
    in the benchmark's order; the directory itself when it has no directory of any named config (the
    files of one config, or of a dataset with only a default one). A snapshot holding some of the
    named configs but not all is an error: a benchmark silently missing a config would mislead."""
    named = [config for config in bench.configs if config is not None]
    present = [directory / config for config in named if (directory / config).is_dir()]
    if not present:
        return directory
    if len(present) != len(named):
        missing = [config for config in named if not (directory / config).is_dir()]
        raise ValueError(f"benchmark {bench.name!r}: the snapshot {directory} lacks the configs {missing}")
    return present


def _has_column(path: Path, column: str) -> bool:
    import pyarrow.parquet as pq

    return column in pq.read_schema(path).names


def _datasets(bench: Benchmark) -> Any:
    """The `datasets` package (benchmarks, local copies included, are read through it), or a ValueError
    saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"benchmark {bench.name!r} is read through `datasets`, which is not installed "
            "(pip install datasets)"
        ) from None
    return datasets


def _local_rows(bench: Benchmark, data_files: str | Path | Sequence[str | Path]) -> list[dict[str, Any]]:
    """Rows of local files through `datasets`' own builders, as the hub's files would be read."""
    datasets = _datasets(bench)

    given = [data_files] if isinstance(data_files, str | Path) else list(data_files)
    paths = [Path(p).expanduser() for p in given]
    if len(paths) == 1 and (paths[0] / "dataset_info.json").exists():  # a save_to_disk copy
        loaded = datasets.load_from_disk(str(paths[0]))
        split = loaded[bench.split] if isinstance(loaded, datasets.DatasetDict) else loaded
        return [dict(row) for row in split]
    files = [file for path in paths for file in _data_files(bench, path)]
    kinds = {"parquet" if file.suffix == ".parquet" else "json" for file in files}
    if len(kinds) != 1:
        raise ValueError(
            f"benchmark {bench.name!r}: {given} must hold .parquet or .jsonl/.json files, one kind"
        )
    table = datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train")
    return [dict(row) for row in table]


def _data_files(bench: Benchmark, path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix not in _SUFFIXES:
            raise ValueError(f"benchmark {bench.name!r}: {path} is not a .parquet, .jsonl or .json file")
        return [path]
    if not path.is_dir():
        raise ValueError(f"benchmark {bench.name!r}: no such file or directory {path}")
    files = sorted(f for f in path.rglob("*") if f.suffix in _SUFFIXES and f.is_file())
    of_split = [
        f for f in files if f.name.startswith(bench.split)
    ]  # a hub snapshot: test.jsonl, test-0000.parquet
    if not (of_split or files):
        raise ValueError(f"benchmark {bench.name!r}: {path} holds no .parquet, .jsonl or .json files")
    return of_split or files


def _hub_rows(bench: Benchmark, local_copy: str) -> list[dict[str, Any]]:
    datasets = _datasets(bench)
    rows: list[dict[str, Any]] = []
    for config in bench.configs:
        try:
            loaded = datasets.load_dataset(bench.dataset, config, split=bench.split)
        except OSError as error:  # ConnectionError offline, FileNotFoundError for a missing dataset
            where = f"{bench.dataset} ({config or 'default'}, split {bench.split})"
            raise ValueError(
                f"benchmark {bench.name!r}: cannot load {where} from the Hugging Face hub "
                f"({type(error).__name__}: {str(error)[:200]}). Pass a local copy in the same schema: "
                + local_copy.format(name=bench.name)
            ) from None
        rows += [dict(row) for row in loaded]
    return rows
