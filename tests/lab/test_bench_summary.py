"""`make bench`'s summary: each ratio computed from the benchmarks' JSON by hand, targets judged on the
right side, a missing result shown as not measured (never an old figure), and the README block
replaced between its markers only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.summary import END, START, markdown, replace_block, summarise


def write(results: Path, name: str, data: object) -> None:
    (results / name).write_text(json.dumps(data), encoding="utf-8")


def test_the_ratios_are_computed_from_the_results_and_judged_against_their_targets(tmp_path: Path) -> None:
    write(tmp_path, "engine.json", {"engine_vs_hf": 3.2})
    sandbox = {
        "plain_python3_-I_-c": {"p50_ms": 10.0},
        "local_bwrap": {
            "oneshot_idle_arrivals": {"p50_ms": 6.0},
            "oneshot_back_to_back": {"p50_ms": 9.0},
            "throughput_runs_per_s": {"8": 40.0},
        },
        "docker": {"oneshot_back_to_back": {"p50_ms": 31.0}, "throughput_runs_per_s": {"8": 20.0}},
    }
    write(tmp_path, "sandbox.json", sandbox)
    write(tmp_path, "trainer.json", {"learner_vs_plain": 0.99})
    write(tmp_path, "engine_smollm2.json", {"engine_vs_hf": 2.9, "model": "smollm2-135m"})
    write(tmp_path, "trainer_smollm2.json", {"learner_vs_plain": 1.04, "model": "smollm2-135m"})
    modes = [{"mode": "glibc", "cpu_vs_glibc": 1.0}, {"mode": "trim", "cpu_vs_glibc": 1.12}]
    write(tmp_path, "host_memory.json", {"modes": modes})
    rows = {row["measure"].split(" ")[0] + str(i): row for i, row in enumerate(summarise(tmp_path))}
    values = [row["value"] for row in rows.values()]
    assert values == [3.2, 0.6, 0.9, 0.5, 31.0, 0.99, None, 2.9, 1.04, 1.12]
    met = [row["met"] for row in rows.values()]
    assert met == [True, False, True, True, False, False, None, False, True, False]
    sources = [row["source"] for row in rows.values()][-3:]
    assert sources == ["engine_smollm2.json", "trainer_smollm2.json", "host_memory.json"]
    table = markdown(list(rows.values()))
    assert "| 3.20× | ≥ 3.00× | yes |" in table and "| 31.0 ms | ≤ 30.0 ms | no |" in table
    assert "| not measured | ≤ 20.0 s | – |" in table
    assert "SmolLM2-135M" in table and "| 2.90× | ≥ 3.00× | no |" in table


def test_a_broken_or_missing_result_is_not_measured(tmp_path: Path) -> None:
    write(tmp_path, "engine.json", {"engine": "renamed"})
    (tmp_path / "trainer.json").write_text("{not json", encoding="utf-8")
    write(tmp_path, "sandbox.json", {"plain_python3_-I_-c": {"p50_ms": 0.0}, "local_bwrap": {}})
    assert all(row["value"] is None and row["met"] is None for row in summarise(tmp_path))


def test_the_readme_block_is_replaced_between_its_markers_only() -> None:
    text = f"before\n{START}\nold table\n{END}\nafter\n"
    assert replace_block(text, "new") == f"before\n{START}\nnew\n{END}\nafter\n"
    for broken in ("no markers", f"{END}\n{START}\n", f"{START}\n{START}\n{END}\n"):
        with pytest.raises(ValueError, match="needs one"):
            replace_block(broken, "new")


def test_the_readme_carries_the_block() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert readme.count(START) == 1 and readme.count(END) == 1
