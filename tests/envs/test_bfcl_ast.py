"""pacerl/BFCL-AST-v0 against bfcl-eval itself: BFCL's possible answers replayed as calls score 1 on
every entry; altered calls are judged as bfcl-eval's `ast_checker` judges them; the env through
gymnasium; and the `bfcl` suite's columns, through `pacerl eval` on a local checkpoint."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import gymnasium
import pytest

import pacerl.envs
from pacerl.agents.evaluation.benchmarks import BENCHMARKS, SUITES, suite_benchmarks
from pacerl.agents.models import build_tiny_moe, save_model
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.envs.bfcl_ast import AST_CATEGORIES, PYTHON_HINT, BFCLASTEnv, ast_tasks
from pacerl.envs.tasks import Task, load_tasks
from pacerl.evaluate import main_eval
from tests.envs.bfcl_ast_reference import action, answer_calls, bfcl_verdict, mutations

SIZES = {"simple_python": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200, "irrelevance": 240}


@pytest.fixture(scope="module")
def env() -> BFCLASTEnv:
    return BFCLASTEnv(tasks=ast_tasks())


def judge(env: BFCLASTEnv, task: Task, message: str) -> tuple[float, dict]:
    env.reset(options={"task": task})
    observation, reward, terminated, truncated, info = env.step(message)
    assert observation == () and terminated and not truncated
    return reward, info


@pytest.mark.parametrize("category", AST_CATEGORIES)
def test_the_possible_answers_score_one_on_every_entry(env: BFCLASTEnv, category: str) -> None:
    tasks = ast_tasks([category])
    rewards = [judge(env, task, action(answer_calls(task)) or "No function fits.")[0] for task in tasks]
    assert len(tasks) == SIZES[category] and rewards == [1.0] * len(tasks)


def test_irrelevance_is_passed_by_not_calling(env: BFCLASTEnv) -> None:
    irrelevant, simple = ast_tasks(["irrelevance"])[0], ast_tasks(["simple_python"])[0]
    stray = action([{"name": irrelevant.metadata["functions"][0]["name"], "arguments": {}}])
    assert judge(env, irrelevant, "None of these functions can do that.")[0] == 1.0
    assert judge(env, irrelevant, "<tool_call>{not json</tool_call>")[0] == 1.0  # decodes to no call
    reward, info = judge(env, irrelevant, stray)
    assert reward == 0.0 and "no function fits" in info["bfcl"]["problem"]
    assert judge(env, simple, "The area is 25 square units.")[0] == 0.0
    assert judge(env, simple, "<tool_call>{not json</tool_call>")[0] == 0.0


def test_altered_calls_are_judged_as_bfcl_eval_judges_them(env: BFCLASTEnv) -> None:
    """Every entry, each altered every way that applies (a name, a value, a required parameter, an
    unknown parameter, a call dropped or reordered, a string restyled, a number as a string or a float),
    judged by the env and by bfcl-eval's own checker."""
    rng, verdicts = random.Random(0), Counter()
    for task in ast_tasks():
        calls = answer_calls(task)
        for kind, altered in {"none": calls, **mutations(task, calls, rng)}.items():
            reward, info = judge(env, task, action(altered) or "Nothing to call.")
            reference = bfcl_verdict(task, altered)
            assert (reward == 1.0) == reference, (task.id, kind, info["bfcl"])
            verdicts[kind, reference] += 1
    assert verdicts["none", True] == 1240
    for kind in (
        "wrong_function",
        "missing_required",
        "unknown_param",
        "missing_call",
        "stray",
        "stringified",
    ):
        assert verdicts[kind, False] > 0 and verdicts[kind, True] == 0, kind
    for kind in ("wrong_value", "shuffled", "restyled", "as_float"):  # both verdicts occur
        assert verdicts[kind, True] > 0 and verdicts[kind, False] > 0, kind


def test_gymnasium_make_poses_the_entry_with_its_functions() -> None:
    env = gymnasium.make("pacerl/BFCL-AST-v0", tasks="bfcl:parallel/eval")
    observation, info = env.reset(seed=0)
    task = env.unwrapped._task
    assert [m["role"] for m in observation] == ["system", "user"] and observation[1][
        "content"
    ] == task.question
    schemas = env.unwrapped.tool_schemas()
    assert (
        [s["function"]["name"] for s in schemas]
        == info["tools"]
        == [f["name"] for f in task.metadata["functions"]]
    )
    assert all(s["function"]["description"].endswith(PYTHON_HINT) for s in schemas)
    assert schemas[0]["function"]["parameters"]["type"] == "object"
    _, reward, terminated, _, _ = env.step(action(answer_calls(task)))
    assert reward == 1.0 and terminated
    env.close()


def test_task_sets_and_their_split() -> None:
    train, held = load_tasks("bfcl:ast/train"), load_tasks("bfcl:ast/eval")
    assert len(train) + len(held) == 1240 and not {t.id for t in train} & {t.id for t in held}
    assert [t.id for t in load_tasks("bfcl:multiple,irrelevance")][199:201] == [
        "multiple_199",
        "irrelevance_0",
    ]


def test_the_suite_is_bfcls_five_ast_columns() -> None:
    assert SUITES["bfcl"] == AST_CATEGORIES
    benchmarks = suite_benchmarks("bfcl")
    assert [b.title for b in benchmarks] == [
        "Simple Python",
        "Multiple",
        "Parallel",
        "Parallel Multiple",
        "Irrelevance",
    ]
    assert all(b.env_id == "pacerl/BFCL-AST-v0" and b.eval_settings["temperature"] == 0.0 for b in benchmarks)
    assert all(b.eval_settings["tool_schemas_in_prompt"] for b in benchmarks)
    assert [len(BENCHMARKS[name].shipped()) for name in AST_CATEGORIES] == list(SIZES.values())  # type: ignore[misc]


def test_pacerl_eval_suite_on_a_local_checkpoint(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer()
    model = save_model(build_tiny_moe(tokenizer=tokenizer), tokenizer, tmp_path / "model")
    out = tmp_path / "bfcl.json"
    settings = ["max_tasks=1", "max_new_tokens=4", "max_total_tokens=2048"]
    overrides = [f"evaluation.settings.{setting}" for setting in settings]
    assert main_eval(str(model), out=str(out), overrides=overrides, suite="bfcl") == 0
    data = json.loads(out.read_text())
    assert [b["name"] for b in data["benchmarks"]] == list(AST_CATEGORIES)
    assert all(b["tasks"] == 1 and b["k"] == 1 for b in data["benchmarks"])


def test_no_model_text_is_evaluated() -> None:
    source = (Path(pacerl.envs.__file__).parent / "bfcl_ast.py").read_text()
    assert not re.search(r"\beval\(|\bexec\(", source)
