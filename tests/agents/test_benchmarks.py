"""Named benchmarks and suites: each loads from its fixture (local parquet in the hub's schema, read by
`datasets` as the hub's files are), maps its fields, is scored by its env, and a suite reports avg@k and
pass@k per benchmark and their average in the papers' layout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import pytest

from pacerl.agents.engine.protocol import FinishReason, Generation, SamplingParams
from pacerl.agents.evaluation.benchmarks import (
    BENCHMARKS,
    MIRROR_ENV,
    SUITES,
    Benchmark,
    gsm8k_answer,
    load_benchmark,
    suite_benchmarks,
)
from pacerl.agents.evaluation.config import EvalConfig
from pacerl.agents.evaluation.play import evaluate
from pacerl.agents.evaluation.report import EvalReport
from pacerl.agents.evaluation.scores import majority_correct
from pacerl.agents.evaluation.suites import benchmark_eval_config, run_suite, suite_markdown
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.envs import Task, load_tasks
from pacerl.envs.registry import env_class
from tests.scripted import ScriptedEngineBase

FIXTURES = Path(__file__).parents[1] / "fixtures" / "suites"
REPO = Path(__file__).parents[2]

EXPECTED: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "aime24": [("aime24-60", ("2",)), ("aime24-61", ("24",)), ("aime24-62", ("011",))],
    "aime25": [("aime25-00", ("19",)), ("aime25-01", ("16",)), ("aime25-02", ("5",))],
    "math500": [
        ("test/prealgebra/1.json", ("\\frac{14}{3}",)),
        ("test/precalculus/807.json", ("\\left( 3, \\frac{\\pi}{2} \\right)",)),
        ("test/algebra/12.json", ("5\\sqrt{2}",)),
    ],
    "gsm8k": [("gsm8k-0000", ("7",)), ("gsm8k-0001", ("6000",)), ("gsm8k-0002", ("-2",))],
    "nq": [
        ("nq-test_0", ("Orlo",)),
        ("nq-test_1", ("1128",)),
        ("nq-test_2", ("Sanim", "the explorer Sanim")),
    ],
    "hotpotqa": [
        ("hotpotqa-test_0", ("1807",)),
        ("hotpotqa-test_1", ("yes",)),
        ("hotpotqa-test_2", ("Sanim",)),
    ],
}
"""Each benchmark's fixture, parsed by hand: task ids and accepted answers."""

RIGHT = {
    "aime24": ["\\boxed{2}", "The answer is $\\boxed{24}$.", "\\boxed{11}"],
    "aime25": ["\\boxed{19}", "\\boxed{16}", "\\boxed{5}"],
    "math500": ["\\boxed{\\dfrac{14}{3}}", "\\boxed{(3, \\frac{\\pi}{2})}", "\\boxed{5\\sqrt 2}"],
    "gsm8k": ["\\boxed{7}", "\\boxed{6000}", "\\boxed{-2}"],
}
WRONG = {
    "aime24": "\\boxed{3}",
    "aime25": "\\boxed{20}",
    "math500": "\\boxed{\\frac{3}{14}}",
    "gsm8k": "\\boxed{8}",
}


def test_registry_names_every_benchmark_the_issue_asks_for() -> None:
    assert {"aime24", "aime25", "math500", "gsm8k", "nq", "hotpotqa"} <= set(BENCHMARKS)
    assert [b.name for b in suite_benchmarks("math")] == ["aime24", "aime25", "math500", "gsm8k"]
    assert [b.title for b in suite_benchmarks("search-r1")] == [
        "NQ",
        "TriviaQA",
        "PopQA",
        "HotpotQA",
        "2Wiki",
        "Musique",
        "Bamboogle",
    ]
    assert [b.name for b in suite_benchmarks("gsm8k")] == ["gsm8k"]
    assert all(member in BENCHMARKS for members in SUITES.values() for member in members)
    gsm8k, hotpotqa = BENCHMARKS["gsm8k"], BENCHMARKS["hotpotqa"]
    assert (gsm8k.dataset, gsm8k.configs, gsm8k.split) == ("openai/gsm8k", ("main",), "test")
    assert (hotpotqa.dataset, hotpotqa.configs, hotpotqa.split) == (
        "RUC-NLPIR/FlashRAG_datasets",
        ("hotpotqa",),
        "dev",
    )
    assert BENCHMARKS["aime25"].configs == ("AIME2025-I", "AIME2025-II")
    with pytest.raises(
        ValueError, match=r"no suite or benchmark named 'mmlu'; suites: math, aime, search-r1"
    ):
        suite_benchmarks("mmlu")


# Benchmarks a package ships (BFCL's) read no fixture: tests/envs/test_bfcl.py scores them.
@pytest.mark.parametrize("name", sorted(name for name, b in BENCHMARKS.items() if b.shipped is None))
def test_each_benchmark_loads_from_its_fixture_and_is_scored_by_its_env(name: str) -> None:
    benchmark = BENCHMARKS[name]
    tasks = load_benchmark(name, mirror=FIXTURES)
    assert len(tasks) == 3 and all(task.question and task.answers for task in tasks)
    if name in EXPECTED:
        assert [(task.id, task.answers) for task in tasks] == EXPECTED[name]
    env = env_class(benchmark.env_id)(tasks=tasks)
    try:
        for index, task in enumerate(tasks):
            right = RIGHT[name][index] if name in RIGHT else f"<answer> {task.answers[-1]} </answer>"
            wrong = WRONG.get(name, "<answer> Atlantis </answer>")
            assert env.score(task, right).total == 1.0, (task.id, right)
            assert env.score(task, wrong).total == 0.0, (task.id, wrong)
    finally:
        env.close()


def test_field_mappings_keep_the_rest_of_each_row() -> None:
    (aime,) = load_benchmark("aime24", data_files=FIXTURES / "aime24.parquet")[:1]
    assert aime.question == "Find the remainder when $2^{10}$ is divided by $7$."
    assert aime.metadata["year"] == "2024" and aime.metadata["id"] == 60
    math = load_benchmark("math500", mirror=FIXTURES)[1]
    assert (math.level, math.metadata["subject"]) == (2, "Precalculus")
    gsm = load_benchmark("gsm8k", mirror=FIXTURES)[1]
    assert gsm.metadata["solution"].endswith("#### 6,000") and gsm.answer == "6000"
    hotpot = load_benchmark("hotpotqa", mirror=FIXTURES)[1]
    assert hotpot.metadata["metadata"] == {"type": "comparison", "level": "medium"}
    assert gsm8k_answer("so 1,234 in all\n#### 1,234") == "1234"
    with pytest.raises(ValueError, match="ends in '#### N'"):
        gsm8k_answer("no marker here")


def test_search_r1_processed_parquet_is_split_by_data_source() -> None:
    nq = load_benchmark("nq", data_files=FIXTURES / "search_r1_test.parquet")
    hotpot = load_benchmark("hotpotqa", data_files=FIXTURES / "search_r1_test.parquet")
    assert [(t.id, t.question, t.answers) for t in nq] == [
        ("nq-test-0", "which explorer first described kaloter?", ("Orlo",)),
        ("nq-test-1", "in which year was venlopha first recorded?", ("1128",)),
    ]
    assert [t.id for t in hotpot] == ["hotpotqa-test-0"]
    assert (
        hotpot[0]
        .metadata["prompt"][0]["content"]
        .endswith("Question: Which explorer first described Orkalo?\n")
    )
    with pytest.raises(ValueError, match="holds no rows \\(of data_source 'popqa'\\)"):
        load_benchmark("popqa", data_files=FIXTURES / "search_r1_test.parquet")


def test_local_copies_jsonl_directories_and_the_mirror_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [{"question": "What is 2+2?", "answer": "2 + 2 = 4\n#### 4"}]
    snapshot = tmp_path / "gsm8k" / "main"
    snapshot.mkdir(parents=True)
    (snapshot / "test-00000-of-00001.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (snapshot / "train-00000-of-00001.jsonl").write_text(
        json.dumps({"question": "x", "answer": "#### 1"}) + "\n"
    )
    monkeypatch.setenv(MIRROR_ENV, str(tmp_path))
    (task,) = load_benchmark("gsm8k")  # the directory <mirror>/gsm8k, its test split only
    assert (task.question, task.answers) == ("What is 2+2?", ("4",))
    with pytest.raises(
        ValueError, match=r"benchmark 'aime24': the mirror .* holds none of .*aime24\.parquet"
    ):
        load_benchmark("aime24")
    monkeypatch.delenv(MIRROR_ENV)
    with pytest.raises(ValueError, match="no such file or directory"):
        load_benchmark("gsm8k", data_files=tmp_path / "missing.parquet")
    with pytest.raises(ValueError, match="row 0: column 'problem' must be a non-empty string, got None"):
        load_benchmark("aime24", data_files=FIXTURES / "gsm8k.parquet")  # another dataset's schema


def test_without_the_hub_or_a_local_copy_loading_fails_at_once_saying_what_to_pass() -> None:
    env = {key: value for key, value in os.environ.items() if key != MIRROR_ENV}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(REPO))
    code = "from pacerl.agents.evaluation.benchmarks import load_benchmark\nload_benchmark('gsm8k')"
    # The timeout only guards against a hang (the hub's retries); offline mode answers at once.
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: benchmark 'gsm8k': cannot load openai/gsm8k (main, split test)")
    assert "data_files=FILE" in last and f"{MIRROR_ENV}=DIR" in last and "mirror=DIR" in last


def test_eval_config_takes_the_benchmarks_protocol_and_the_users_overrides() -> None:
    aime = benchmark_eval_config(BENCHMARKS["aime24"], EvalConfig(max_new_tokens=4096))
    assert (aime.samples, aime.temperature, aime.max_new_tokens, aime.all_ks) == (32, 0.6, 4096, (1, 32))
    nq = benchmark_eval_config(BENCHMARKS["nq"], EvalConfig(ks=(1, 4)))
    assert (nq.samples, nq.temperature, nq.stop_strings, nq.ks) == (1, 0.0, ("</search>", "</answer>"), (1,))
    assert (nq.max_new_tokens, nq.max_total_tokens) == (500, 4096)
    mine = benchmark_eval_config(BENCHMARKS["aime24"], None, {"samples": 4, "ks": (1, 2, 8)})
    assert (mine.samples, mine.temperature, mine.ks) == (4, 0.6, (1, 2))
    with pytest.raises(ValueError, match="temperature 0 is greedy"):
        benchmark_eval_config(BENCHMARKS["gsm8k"], None, {"samples": 4})


class AnswersByScript(ScriptedEngineBase):
    """Per task (found by its question in the prompt): the first is right on its first sample only, the
    second always, the third never; the answer in the format its env reads."""

    def __init__(self, tokenizer: object, tasks: dict[str, tuple[int, Task, bool]]) -> None:
        self.tokenizer = tokenizer
        self.tasks = tasks
        self.calls: Counter[str] = Counter()

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, request_id: str | None = None,
        return_routed_experts: bool = False, session: str | None = None,
    ) -> Generation:  # fmt: skip
        text = self.tokenizer.decode(list(input_ids), skip_special_tokens=False)  # type: ignore[attr-defined]
        question = next(q for q in sorted(self.tasks, key=len, reverse=True) if q in text)
        position, task, tagged = self.tasks[question]
        sample = self.calls[question]
        self.calls[question] += 1
        right = position == 1 or (position == 0 and sample == 0)
        answer = task.answers[0] if right else "Atlantis"
        turn = f"<answer> {answer} </answer>" if tagged else f"\\boxed{{{answer}}}"
        tokens = tuple(self.tokenizer.encode(turn, add_special_tokens=False))  # type: ignore[attr-defined]
        return Generation(tokens, (-0.1,) * len(tokens), (0,) * len(tokens), FinishReason.STOP)


@pytest.mark.parametrize("suite", ["math", "nq-hotpotqa"])
async def test_a_suite_evaluates_on_its_fixtures_into_the_papers_table(suite: str) -> None:
    tokenizer = tiny_tokenizer()
    seen: list[tuple[str, int, float]] = []

    async def play(benchmark: Benchmark) -> EvalReport:
        tasks = load_benchmark(benchmark, mirror=FIXTURES)
        cls = env_class(benchmark.env_id)
        tagged = benchmark.env_id == "pacerl/SearchR1-v0"
        engine = AnswersByScript(tokenizer, {t.question: (i, t, tagged) for i, t in enumerate(tasks)})
        given = {"samples": 2, "temperature": 1.0, "max_new_tokens": 32, "max_total_tokens": 2048}
        config = benchmark_eval_config(benchmark, EvalConfig(), given)
        seen.append((benchmark.name, config.samples, config.temperature))
        return await evaluate(
            engine, tokenizer, lambda: cls(tasks=tasks), tasks, config, label=benchmark.name
        )

    reports = {b.name: await play(b) for b in suite_benchmarks(suite)}
    result = run_suite(suite, lambda benchmark: reports[benchmark.name], label="scripted")
    names = [b.name for b in suite_benchmarks(suite)]
    assert [r.benchmark.name for r in result.results] == names and [s[0] for s in seen] == names
    # Per benchmark: tasks right 1/2, 2/2, 0/2: avg@2 = 1/2; pass@2 = (1 + 1 + 0) / 3.
    for r in result.results:
        assert (r.k, r.report.tasks) == (2, 3) and r.avg_at_k == pytest.approx(0.5)
        assert r.pass_at_k == pytest.approx(2 / 3)
    assert result.average_avg_at_k == pytest.approx(0.5)
    assert result.average_pass_at_k == pytest.approx(2 / 3)
    titles = [f"{b.title} (k=2)" for b in suite_benchmarks(suite)]
    markdown = result.markdown().splitlines()
    assert markdown[0] == "| " + " | ".join(["model", "metric", *titles, "Avg."]) + " |"
    assert markdown[2] == "| scripted | avg@k | " + " | ".join(["50.0"] * (len(names) + 1)) + " |"
    assert markdown[3] == "| scripted | pass@k | " + " | ".join(["66.7"] * (len(names) + 1)) + " |"
    # maj@2: the first task's right and wrong answers tie, the right one came first; 2 of 3 tasks.
    assert markdown[4] == "| scripted | maj@k | " + " | ".join(["66.7"] * (len(names) + 1)) + " |"
    for r in result.results:
        assert [t.majority_correct for t in r.report.per_task] == [True, True, False]
        assert r.maj_at_k == pytest.approx(2 / 3) and "maj@2" in r.report.table()
    table = result.table()
    assert all(title.split(" (")[0] in table for title in titles) and "Avg." in table and "66.7" in table
    data = json.loads(json.dumps(result.to_json()))
    assert data["suite"] == suite and data["average"]["pass_at_k"] == pytest.approx(2 / 3)
    assert data["average"]["maj_at_k"] == pytest.approx(2 / 3) == data["benchmarks"][0]["maj_at_k"]
    assert [b["name"] for b in data["benchmarks"]] == names and data["benchmarks"][0]["report"][
        "samples"
    ] == 2
    with pytest.raises(ValueError, match="same benchmarks and k"):
        other = run_suite(names[0], lambda benchmark: reports[benchmark.name], label="other")
        suite_markdown([result, other])


def test_majority_vote_against_hand_counted_votes() -> None:
    """maj@k of one task: the most frequent answer decides; ties go to the answer given first;
    whitespace does not split votes; samples without an answer do not vote."""
    assert majority_correct(["4", "5", "5", "4", None], [True, False, False, True, False])  # tie: 4 first
    assert not majority_correct(["5", "4", "4", "5"], [False, True, True, False])  # tie: 5 first
    assert not majority_correct(["1", "2", "2"], [True, False, False])  # 2 wins 2:1
    assert (
        majority_correct([" 1/2", "1/2 ", "0.5", "0.5", "0.5 "], [True, True, False, False, False]) is False
    )
    assert majority_correct([None, None, "7"], [False, False, True])  # one vote is a majority
    assert not majority_correct([None, None], [False, False]) and not majority_correct([], [])
    with pytest.raises(ValueError, match="one correctness per answer"):
        majority_correct(["1"], [True, False])
    # Three tasks, solved by the vote 0, 1, 1 of them: maj@k = 2/3.
    votes = [
        (["a", "b", "b"], [True, False, False]),
        (["c", "c", None], [True, True, False]),
        (["x"], [True]),
    ]
    assert sum(majority_correct(a, c) for a, c in votes) / 3 == pytest.approx(2 / 3)


def test_a_hub_snapshot_mirror_loads_the_benchmarks_configs_only(tmp_path: Path) -> None:
    """`<mirror>/gsm8k/{main,socratic}/test-*.parquet`, as `huggingface-cli download` lays out
    openai/gsm8k: gsm8k's one config, `main`, is read (3 tasks, not 6 from both configs); aime25's two
    configs are read in order; a snapshot lacking one of a benchmark's configs is refused."""
    for config in ("main", "socratic"):
        (tmp_path / "gsm8k" / config).mkdir(parents=True)
        shutil.copy(FIXTURES / "gsm8k.parquet", tmp_path / "gsm8k" / config / "test-00000-of-00001.parquet")
    socratic = pd.read_parquet(tmp_path / "gsm8k" / "socratic" / "test-00000-of-00001.parquet")
    socratic["answer"] = "How many? ** 1\n#### 1"
    socratic.to_parquet(tmp_path / "gsm8k" / "socratic" / "test-00000-of-00001.parquet")
    tasks = load_benchmark("gsm8k", mirror=tmp_path)
    assert [t.answers for t in tasks] == [t.answers for t in load_benchmark("gsm8k", mirror=FIXTURES)]
    assert [t.answer for t in tasks] == ["7", "6000", "-2"]  # `main`'s rows through gsm8k's mapping
    rows = pd.read_parquet(FIXTURES / "aime25.parquet")
    for config, part in (("AIME2025-I", rows[:2]), ("AIME2025-II", rows[2:])):
        (tmp_path / "aime25" / config).mkdir(parents=True)
        part.to_parquet(tmp_path / "aime25" / config / "test-00000-of-00001.parquet")
    assert [t.question for t in load_benchmark("aime25", mirror=tmp_path)] == list(rows["question"])
    shutil.rmtree(tmp_path / "aime25" / "AIME2025-II")
    with pytest.raises(ValueError, match=r"lacks the configs \['AIME2025-II'\]"):
        load_benchmark("aime25", mirror=tmp_path)


def test_search_r1s_merged_test_parquet_serves_every_qa_benchmark(tmp_path: Path) -> None:
    """A mirror holding only Search-R1's merged `test.parquet`: each QA benchmark takes its own rows
    (`data_source`), posed with their own prompt; a math benchmark is not looked for in it."""
    shutil.copy(FIXTURES / "search_r1_test.parquet", tmp_path / "test.parquet")
    nq = load_benchmark("nq", mirror=tmp_path)
    (hotpot,) = load_benchmark("hotpotqa", mirror=tmp_path)
    assert [t.answers for t in nq] == [("Orlo",), ("1128",)]
    assert hotpot.answers == ("Sanim", "the explorer Sanim") and "prompt" in hotpot.metadata
    with pytest.raises(ValueError, match="holds no rows"):
        load_benchmark("popqa", mirror=tmp_path)
    with pytest.raises(ValueError, match=r"the mirror .* holds none of"):
        load_benchmark("gsm8k", mirror=tmp_path)


GSM8K_CARD = """---
dataset_info:
  features:
  - name: question
    dtype: string
configs:
- config_name: main
  data_files:
  - split: train
    path: train_main.parquet
  - split: test
    path: tests/main-*.parquet
- config_name: socratic
  data_files:
  - split: test
    path: tests/socratic-*.parquet
---
# GSM8K
"""


def test_a_snapshots_dataset_card_maps_configs_and_splits_to_files(tmp_path: Path) -> None:
    """A snapshot whose README.md maps each config's splits to files (the hub's `configs:` header) is
    read through that map: gsm8k's `main` test files only; the default config of a one-config set;
    an unmapped config is refused."""
    snapshot = tmp_path / "gsm8k"
    (snapshot / "tests").mkdir(parents=True)
    (snapshot / "README.md").write_text(GSM8K_CARD)
    rows = pd.read_parquet(FIXTURES / "gsm8k.parquet")
    rows[:2].to_parquet(snapshot / "tests" / "main-00000-of-00002.parquet")
    rows[2:].to_parquet(snapshot / "tests" / "main-00001-of-00002.parquet")
    rows.assign(answer="#### 1").to_parquet(snapshot / "tests" / "socratic-00000-of-00001.parquet")
    rows.assign(answer="#### 2").to_parquet(snapshot / "train_main.parquet")
    assert [t.answer for t in load_benchmark("gsm8k", mirror=tmp_path)] == ["7", "6000", "-2"]
    card = "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
    card += "    path: data/train-*\n---\n"
    (tmp_path / "aime24" / "data").mkdir(parents=True)
    (tmp_path / "aime24" / "README.md").write_text(card)
    shutil.copy(FIXTURES / "aime24.parquet", tmp_path / "aime24" / "data" / "train-00000-of-00001.parquet")
    assert len(load_benchmark("aime24", mirror=tmp_path)) == 3
    (snapshot / "README.md").write_text(GSM8K_CARD.replace("config_name: main", "config_name: other"))
    with pytest.raises(ValueError, match=r"the dataset card of .* maps no config 'main'"):
        load_benchmark("gsm8k", mirror=tmp_path)


def test_offline_the_command_line_names_its_own_flag_for_a_local_copy() -> None:
    env = {key: value for key, value in os.environ.items() if key != MIRROR_ENV}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    command = [sys.executable, "-m", "pacerl", "eval", "--model", "smollm2-135m", "--suite", "gsm8k"]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and last.startswith(
        "pacerl: error: --suite gsm8k: benchmark 'gsm8k': cannot load"
    )
    assert "--suite-dir DIR, a directory holding gsm8k.parquet" in last and f"{MIRROR_ENV}=DIR" in last
    assert "data_files=" not in last and "mirror=DIR" not in last


def test_without_datasets_a_local_copy_is_refused_saying_what_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['datasets'] = None  # as if it were not installed\n"
        "from pacerl.agents.evaluation.benchmarks import load_benchmark\n"
        f"load_benchmark('gsm8k', data_files={str(FIXTURES / 'gsm8k.parquet')!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last == (
        "ValueError: benchmark 'gsm8k' is read through `datasets`, which is not installed "
        "(pip install datasets)"
    )


def test_the_bfcl_family_scores_one_side_of_the_envs_split() -> None:
    """`bfcl-multi-turn:eval` holds exactly the entries BFCL-MultiTurn-v0's default training set leaves
    out, in BFCL's four columns; together the two parts are the whole suite."""
    held = suite_benchmarks("bfcl-multi-turn:eval")
    trained = suite_benchmarks("bfcl-multi-turn:train")
    whole = suite_benchmarks("bfcl-multi-turn")
    assert [b.name for b in held] == [b.name for b in whole] == [b.name for b in trained]
    for part_held, part_trained, full in zip(held, trained, whole, strict=True):
        held_ids = {t.id for t in load_benchmark(part_held)}
        trained_ids = {t.id for t in load_benchmark(part_trained)}
        assert held_ids and not held_ids & trained_ids
        assert held_ids | trained_ids == {t.id for t in load_benchmark(full)}
    assert not {t.id for t in load_tasks("bfcl:multi_turn/train")} & {
        t.id for b in held for t in load_benchmark(b)
    }
    with pytest.raises(ValueError, match="the part is train or eval"):
        suite_benchmarks("bfcl-multi-turn:test")
