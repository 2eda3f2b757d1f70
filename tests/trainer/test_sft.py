"""SFT warm start: demonstrations token-exact with what the rollout driver records, the teacher's
behaviour gap, and a tiny MoE that learns the demonstrations."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Literal

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from pacerl.agents.engine.protocol import FinishReason, Generation, SamplingParams
from pacerl.agents.models import TinyMoEConfig, build_tiny_moe
from pacerl.agents.rollout import RolloutConfig, RolloutDriver
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.agents.trajectory import Status, Trajectory
from pacerl.envs import Task, ToolEnv, ToolEnvConfig, load_tasks
from pacerl.envs.code_math import CodeMathEnv, is_easy
from pacerl.envs.math import MathEnv
from pacerl.envs.retriever import BM25Index, create_app
from pacerl.envs.search import SearchEnv
from pacerl.envs.tasks import DATA_DIR
from pacerl.trainer.sft import Demonstration, SFTConfig, demonstrations, render_demonstration, sft
from tests.helpers import ThreadServer
from tests.scripted import ScriptedEngineBase

CODEMATH = load_tasks("codemath-train")


class ScriptedEngine(ScriptedEngineBase):
    """Plays fixed assistant turns, given as token ids, through the engine protocol."""

    def __init__(self, turns: Sequence[Sequence[int]]) -> None:
        self.turns = [list(turn) for turn in turns]

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        return_routed_experts: bool = False,
        session: str | None = None,
    ) -> Generation:
        tokens = tuple(self.turns.pop(0))
        return Generation(tokens, (-0.5,) * len(tokens), (0,) * len(tokens), FinishReason.STOP)


def model_turns(demo: Demonstration) -> list[list[int]]:
    """The runs of trained tokens: one per assistant turn (a tool turn always separates two)."""
    turns: list[list[int]] = []
    previous = False
    for token, trained in zip(demo.tokens, demo.loss_mask, strict=True):
        if trained and not previous:
            turns.append([])
        if trained:
            turns[-1].append(token)
        previous = trained
    return turns


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def retriever_url() -> Iterator[str]:
    with ThreadServer(create_app(BM25Index.from_jsonl(DATA_DIR / "search-corpus.jsonl"))) as server:
        yield server.url


async def record(
    tokenizer: PreTrainedTokenizerFast, env: ToolEnv, task: Task, turns: list[list[int]], tools: bool
) -> Trajectory:
    """The trajectory the real driver records when the model emits `turns` on `task`."""
    config = RolloutConfig(
        group_size=1,
        tool_schemas_in_prompt=tools,
        sampling=SamplingParams(max_new_tokens=64, temperature=1.0),
        max_total_tokens=1024,
    )
    driver = RolloutDriver(ScriptedEngine(turns), tokenizer, lambda: env, config)
    (trajectory,) = await driver.rollout_group(task)
    return trajectory


@pytest.mark.parametrize(("system_prompt", "tools"), [("", False), (None, True)])
@pytest.mark.parametrize("env_id", ["pacerl/CodeMath-v0", "pacerl/Math-v0", "pacerl/Search-v0"])
async def test_demonstrations_are_what_the_rollout_driver_records(
    tokenizer: PreTrainedTokenizerFast,
    retriever_url: str,
    env_id: str,
    system_prompt: str | None,
    tools: bool,
) -> None:
    config = ToolEnvConfig(system_prompt=system_prompt)
    if env_id == "pacerl/CodeMath-v0":
        tasks = [CODEMATH[0], CODEMATH[1]]  # an easy and a hard problem
        make: type[ToolEnv] = CodeMathEnv
    elif env_id == "pacerl/Math-v0":
        tasks, make = load_tasks("math-train")[:2], MathEnv
    else:
        tasks, make = load_tasks("search-train")[:2], SearchEnv
        config = replace(config, tool_formats=("hermes",), settings={"retriever_url": retriever_url})
    style: Literal["clean", "teacher"] = "teacher" if env_id == "pacerl/CodeMath-v0" else "clean"
    demos = demonstrations(
        env_id,
        tasks,
        style=style,
        system_prompt=system_prompt,
        tool_schemas=tools,
        tokenizer=tokenizer,
    )
    for task, demo in zip(tasks, demos, strict=True):
        trajectory = await record(
            tokenizer, make(tasks=[task], config=config), task, model_turns(demo), tools
        )
        assert trajectory.status is Status.COMPLETED and trajectory.reward == 1.0, trajectory.status_reason
        assert tuple(trajectory.tokens.tolist()) == demo.tokens
        assert tuple(trajectory.loss_mask.tolist()) == demo.loss_mask
        assert demo.task_id == task.id


async def test_an_engine_stopping_at_the_tool_call_records_the_same_tokens(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    """With `</tool_call>` as a stop string the model never emits the eos that closes a tool-call turn:
    the driver writes it into the tool turn. Same tokens; only those eos tokens are untrained."""
    task = CODEMATH[1]
    (demo,) = demonstrations("pacerl/CodeMath-v0", [task], style="clean", tokenizer=tokenizer)
    eos = tokenizer.eos_token_id
    call, answer = model_turns(demo)
    assert call[-1] == eos and tokenizer.decode(call[-2:-1]) == "</tool_call>"
    env = CodeMathEnv(tasks=[task], config=ToolEnvConfig(system_prompt=""))
    trajectory = await record(tokenizer, env, task, [call[:-1], answer], tools=False)
    assert tuple(trajectory.tokens.tolist()) == demo.tokens
    differs = [i for i, (a, b) in enumerate(zip(trajectory.loss_mask, demo.loss_mask, strict=True)) if a != b]
    assert len(differs) == 1 and demo.tokens[differs[0]] == eos and demo.loss_mask[differs[0]]


def test_render_demonstration_refuses_what_the_driver_cannot_record(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    user = {"role": "user", "content": "What is 2 + 2?"}
    answer = {"role": "assistant", "content": "\\boxed{4}"}
    tokens, mask = render_demonstration(tokenizer, [user, answer])
    assert tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if m]) == "\\boxed{4}<|im_end|>"
    with pytest.raises(ValueError, match="prompt messages followed by"):
        render_demonstration(tokenizer, [user])
    with pytest.raises(ValueError, match="ends with the final assistant"):
        render_demonstration(tokenizer, [user, answer, {"role": "tool", "content": "4"}])
    with pytest.raises(ValueError, match="no tool turn follows"):
        render_demonstration(tokenizer, [user, answer, answer])
    with pytest.raises(ValueError, match="no trained token"):
        Demonstration((1, 2), (True, False), "t")
    with pytest.raises(ValueError, match="teacher"):
        demonstrations("pacerl/Math-v0", CODEMATH[:1], style="teacher", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="arithmetic"):
        demonstrations("pacerl/CodeMath-v0", [Task("q", "Why?", ("42",))], tokenizer=tokenizer)


def test_teacher_skips_the_tool_on_easy_problems_only(tokenizer: PreTrainedTokenizerFast) -> None:
    tasks = CODEMATH[:1000]
    demos = demonstrations("pacerl/CodeMath-v0", tasks, style="teacher", tokenizer=tokenizer)
    call_id = tokenizer.convert_tokens_to_ids("<tool_call>")
    direct = [call_id not in demo.tokens for demo in demos]
    easy = [is_easy(task) for task in tasks]
    assert 0.6 < sum(easy) / len(easy) < 0.9
    assert not any(d for d, e in zip(direct, easy, strict=True) if not e)  # hard: always the tool
    rate = sum(d for d, e in zip(direct, easy, strict=True) if e) / sum(easy)
    assert abs(rate - 0.8) < 0.05, rate  # 0.8 ± 3.5 standard errors on about 750 easy problems
    clean = demonstrations("pacerl/CodeMath-v0", tasks[:100], style="clean", tokenizer=tokenizer)
    assert all(call_id in demo.tokens for demo in clean)


def test_demonstrations_are_deterministic_per_seed_and_task(tokenizer: PreTrainedTokenizerFast) -> None:
    tasks = CODEMATH[:200]

    def teacher(tasks: Sequence[Task], seed: int) -> list[Demonstration]:
        return demonstrations("pacerl/CodeMath-v0", tasks, seed=seed, style="teacher", tokenizer=tokenizer)

    first = teacher(tasks, 0)
    assert teacher(tasks, 0) == first
    assert teacher(tasks, 1) != first
    assert teacher(tasks[100:], 0) == first[100:]  # a task's draw does not depend on its neighbours


@pytest.mark.slow
def test_a_tiny_moe_learns_the_demonstrations(tokenizer: PreTrainedTokenizerFast) -> None:
    demos = demonstrations("pacerl/CodeMath-v0", CODEMATH[:200], tokenizer=tokenizer)
    model = build_tiny_moe(TinyMoEConfig(), tokenizer)
    seen: list[tuple[int, float]] = []

    def on_step(step: int, loss: float) -> bool:
        seen.append((step, loss))
        assert model.training
        return False

    losses = sft(model, demos, SFTConfig(batch_size=32, steps=40), on_step=on_step)
    assert len(losses) == 40 and seen == list(enumerate(losses))
    assert losses[-1] < 0.4 * losses[0], losses
    assert not model.training


def test_sft_stops_when_asked_and_is_reproducible(tokenizer: PreTrainedTokenizerFast) -> None:
    demos = demonstrations("pacerl/Math-v0", load_tasks("math-train")[:20], tokenizer=tokenizer)
    config = SFTConfig(batch_size=8, steps=10, warmup_steps=2, seed=3)
    runs = []
    for _ in range(2):
        model = build_tiny_moe(TinyMoEConfig(num_layers=1), tokenizer)
        runs.append(sft(model, demos, config, on_step=lambda step, loss: step == 2))
    assert len(runs[0]) == 3 and runs[0] == runs[1]
    # sft passes no attention mask: right padding never reaches a real token of a causal model.
    short = demos[0]
    (long,) = demonstrations("pacerl/CodeMath-v0", CODEMATH[1:2], tokenizer=tokenizer)
    padded = torch.tensor([list(long.tokens), [*short.tokens] + [0] * (len(long.tokens) - len(short.tokens))])
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([short.tokens])).logits[0]
        batched = model(input_ids=padded).logits[1, : len(short.tokens)]
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="lr"):
        SFTConfig(lr=0.0)
    with pytest.raises(ValueError, match="no demonstrations"):
        sft(model, [], config)


def test_the_loss_is_the_mean_cross_entropy_over_every_trained_token(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    """The first step's loss, by hand: each demonstration alone through the full vocabulary projection,
    the cross-entropy of every masked target, averaged over the batch's targets. sft projects only the
    positions from the batch's first target on; that must not change it."""
    demos = demonstrations("pacerl/CodeMath-v0", CODEMATH[:6], style="teacher", tokenizer=tokenizer)
    assert len({d.loss_mask.index(True) for d in demos}) > 1  # the first targets differ between rows
    model = build_tiny_moe(TinyMoEConfig(num_layers=1), tokenizer)
    total, count = 0.0, 0
    with torch.no_grad():
        for demo in demos:
            logits = model(input_ids=torch.tensor([demo.tokens])).logits[0, :-1].double()
            targets = torch.tensor(demo.tokens[1:])
            trained = torch.tensor(demo.loss_mask[1:])
            losses = -logits.log_softmax(-1).gather(1, targets[:, None])[:, 0]
            total += float(losses[trained].sum())
            count += int(trained.sum())
    (first,) = sft(model, demos, SFTConfig(batch_size=len(demos), steps=1, lr=1e-9))
    assert first == pytest.approx(total / count, rel=1e-5)
