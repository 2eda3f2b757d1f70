"""Every supported MoE family (`pacerl.agents.models.MOE_FAMILIES`) through the front doors, as a user brings
a checkpoint: a random tiny model of the family with a tokenizer carrying a real chat template (Qwen2.5's
or Qwen3's for the Qwen families, Llama 3.1's for the others: any template of the model's own, not
pacerl's), saved with `save_pretrained`, trains two steps with R3 (`pacerl train`'s `train`, on
CodeMath-v0 with a stand-in reward a random model earns in varying amounts, so that the steps update) and is
evaluated with its tools rendered by that template (`pacerl eval`'s `main_eval`); an MoE family
without an adapter is refused before any step."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from pacerl.agents.models import MOE_FAMILIES, UnsupportedMoEError, load_model, moe_info, save_model
from pacerl.config import RunConfig, load_config
from pacerl.envs import Task
from pacerl.envs.chat_template import CHATML_TOOLS_TEMPLATE
from pacerl.envs.code_math import SYSTEM_PROMPT, CodeMathEnv
from pacerl.envs.rewards import Reward
from pacerl.evaluate import main_eval
from pacerl.train import train
from pacerl.trainer.metrics import read_metrics
from tests.agents.helpers import UNSUPPORTED, build_tiny, common_sizes, family_tokenizer

TEMPLATE_OF = {"qwen2_moe": "qwen2.5", "qwen3_moe": "qwen3"}
"""The chat template each family's tokenizer carries; Llama 3.1's (not ChatML at all) for the rest."""

MARKERS = {
    "qwen2.5": "You are provided with function signatures within <tools></tools> XML tags:",
    "qwen3": "You are provided with function signatures within <tools></tools> XML tags:",
    "llama3.1": "Given the following functions, please respond with a JSON for a function call",
}
"""Text only the family's template writes around the tool schemas."""

PACERL_MARKER = "Their signatures are within <tools></tools>:"
"""What pacerl's own template (`CHATML_TOOLS_TEMPLATE`) writes there instead."""

CONTEXT = 1024
"""Positions of the tiny models: CodeMath's prompt with its tool schemas takes about 500 tokens of the
small tokenizers under the Qwen templates, 820 under Llama 3.1's."""

TASKS = [Task("t1", "What is 2 + 3?", ("5",)), Task("t2", "What is 4 + 4?", ("8",))]


class SpreadRewardCodeMathEnv(CodeMathEnv):
    """pacerl/CodeMath-v0 (its prompt, python tool and turns) scored by a stand-in reward that a random
    model's messages spread over [0, 1], a character checksum: CodeMath's own reward is 0 for every
    episode of a random model, and a batch of equal rewards trains nothing."""

    def score(self, task: Task, final_message: str) -> Reward:
        value = sum(map(ord, final_message)) % 101 / 100
        return Reward(value, value, 1.0)


SPREAD_ID = "families/SpreadRewardCodeMath-v0"
if SPREAD_ID not in gymnasium.registry:
    gymnasium.register(id=SPREAD_ID, entry_point=f"{__name__}:SpreadRewardCodeMathEnv")

RUN = [
    f"env.id={__name__}:{SPREAD_ID}",
    "env.system_prompt=null",  # the env's own instructions
    "env.max_turns=1",
    "rollout.tool_schemas_in_prompt=true",
    "rollout.sampling.max_new_tokens=8",
    f"rollout.max_total_tokens={CONTEXT}",
    "rollout.group_size=2",
    "loop.steps=2",
    "loop.batch_groups=2",
    "filter.pace.target_groups=2",
    "filter.max_concurrent_groups=2",
    "evaluation.every=0",
    "evaluation.at_start=false",
    "evaluation.at_end=false",
    "learner.routing_replay=true",
    "learner.lr=1e-3",
]
"""Two steps of two groups of two short single-turn episodes, tools in the prompt, R3 on."""


@pytest.fixture(scope="module")
def task_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    path.write_text("".join(json.dumps(task.to_row()) + "\n" for task in TASKS))
    return path


def run_config(model: Path, run_dir: Path, tasks: Path) -> RunConfig:
    return load_config(None, [f"model.path={model}", f"run_dir={run_dir}", f"env.tasks={tasks}", *RUN])


def own_rendering(tokenizer: PreTrainedTokenizerBase, template: str | None = None) -> str:
    """The prompt of `TASKS[0]` on CodeMath-v0 with its tool schemas, rendered by `tokenizer`'s template
    (or by `template`)."""
    env = CodeMathEnv(tasks=TASKS)
    try:
        messages, _ = env.reset(options={"task": TASKS[0]})
        tools: list[dict[Any, Any] | Callable[..., Any]] = list(env.tool_schemas())
    finally:
        env.close()
    text = tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=True, chat_template=template
    )
    assert isinstance(text, str)
    return text


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_family_trains_with_r3_and_evaluates_in_its_own_template(
    family: str, task_file: Path, tmp_path: Path
) -> None:
    template = TEMPLATE_OF.get(family, "llama3.1")
    tokenizer = family_tokenizer(template)
    model = build_tiny(family, tokenizer=tokenizer, max_position_embeddings=CONTEXT)
    initial = save_model(model, tokenizer, tmp_path / "initial")

    # (1) two steps of RL with R3 through `pacerl train`'s entry point.
    run_dir = tmp_path / "run"
    summary = asyncio.run(train(run_config(initial, run_dir, task_file)))
    assert summary["step"] == 2 and summary["version"] == 2, summary
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "r3_coverage" in row]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["updated"] == 1.0 and row["r3_coverage"] == 1.0 for row in rows), rows
    before, _ = load_model(initial)
    after, saved_tokenizer = load_model(run_dir / "model")
    assert after.config.model_type == family
    assert saved_tokenizer.chat_template == tokenizer.chat_template  # the run keeps the model's template
    routers_before = [gate.get_parameter("weight") for gate in moe_info(before).gates]
    routers_after = [gate.get_parameter("weight") for gate in moe_info(after).gates]
    # The routers learned too: through the gate weights recomputed over the replayed experts.
    assert all(not torch.equal(a, b) for a, b in zip(routers_after, routers_before, strict=True))

    # (2) `pacerl eval` of the trained model, the env's own instructions and tools in the prompt.
    episodes = tmp_path / "episodes.jsonl"
    code = main_eval(
        str(run_dir / "model"), "pacerl/CodeMath-v0", 1, tasks=str(task_file), max_tasks=1,
        episodes=str(episodes),
        overrides=[
            "env.system_prompt=null", "evaluation.settings.tool_schemas_in_prompt=true",
            "evaluation.settings.max_new_tokens=8", f"evaluation.settings.max_total_tokens={CONTEXT}",
            "env.max_turns=1",
        ],
    )  # fmt: skip
    assert code == 0
    (episode,) = [json.loads(line) for line in episodes.read_text().splitlines()]
    prompt = episode["segments"][0]
    assert prompt["origin"] == "prompt" and episode["task_id"] == TASKS[0].id
    text = prompt["text"]
    assert text == own_rendering(tokenizer)
    assert MARKERS[template] in text and SYSTEM_PROMPT in text and '"name": "python"' in text
    assert PACERL_MARKER not in text and text != own_rendering(tokenizer, CHATML_TOOLS_TEMPLATE)
    assert any(segment["origin"] == "model" for segment in episode["segments"])  # it generated


def test_an_moe_family_without_an_adapter_is_refused_before_any_step(task_file: Path, tmp_path: Path) -> None:
    tokenizer = family_tokenizer("llama3.1")
    config = AutoConfig.for_model(UNSUPPORTED, **{**common_sizes(len(tokenizer)), "num_local_experts": 4})
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    initial = save_model(model, tokenizer, tmp_path / "initial")
    run_dir = tmp_path / "run"
    message = rf"'{UNSUPPORTED}' is a mixture-of-experts model.*qwen2_moe, qwen3_moe, mixtral.*routing_replay"
    with pytest.raises(UnsupportedMoEError, match=message):
        asyncio.run(train(run_config(initial, run_dir, task_file)))
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
