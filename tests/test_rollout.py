"""The rollout driver: token-exact records, version-tagged segments across weight updates, many
concurrent episodes, and failures that never kill the batch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence

import pytest
import torch

from agents.engine import EmbeddedEngine, FinishReason, Generation, SamplingParams
from agents.models import TinyMoEConfig, build_tiny_moe
from agents.rollout import RolloutConfig, RolloutDriver
from agents.tokenizer import tiny_tokenizer
from agents.trajectory import Origin, Status
from envs import Task, load_tasks
from envs.code_math import CodeMathEnv

TASK = Task("t1", "What is 123 * 45?", ("5535",))
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(123 * 45)"}}</tool_call>'


class ScriptedEngine:
    """Plays fixed assistant turns through the engine protocol (a scripted policy, not a model).

    `abort_first` splits the first turn like an engine interrupted by a weight update: the first call
    returns half the tokens with finish reason `abort`, the next call (under version + 1) the rest.
    """

    def __init__(self, tokenizer: object, turns: Sequence[str], abort_first: bool = False) -> None:
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.abort_first = abort_first
        self._version = 0
        self.calls: list[list[int]] = []
        self._pending: list[int] = []

    @property
    def version(self) -> int:
        return self._version

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, request_id: str | None = None,
        return_routed_experts: bool = False,
    ) -> Generation:  # fmt: skip
        self.calls.append(list(input_ids))
        if not self._pending:
            self._pending = self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False)  # type: ignore[attr-defined]
        tokens, reason = self._pending, FinishReason.STOP
        if self.abort_first:
            self.abort_first = False
            tokens, reason = tokens[: len(tokens) // 2], FinishReason.ABORT
        self._pending = self._pending[len(tokens) :]
        generation = Generation(tuple(tokens), (-0.5,) * len(tokens), (self._version,) * len(tokens), reason)
        if reason is FinishReason.ABORT:
            self._version += 1
        return generation

    async def abort(self, request_id: str) -> None:
        return None

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._version = version

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return tiny_tokenizer()


async def test_record_decodes_to_exactly_the_rendered_conversation(tokenizer: object) -> None:
    engine = ScriptedEngine(tokenizer, [CALL, "The product is \\boxed{5535}.<|im_end|>"], abort_first=True)
    driver = RolloutDriver(engine, tokenizer, lambda: CodeMathEnv(tasks=[TASK]), RolloutConfig(group_size=1))
    (trajectory,) = await driver.rollout_group(TASK)
    assert trajectory.status is Status.COMPLETED and trajectory.reward == 1.0
    env = CodeMathEnv(tasks=[TASK])
    observation, _ = env.reset(options={"task": TASK})
    tool_messages, *_ = env.step(CALL)
    env.close()
    conversation = [
        *observation,
        {"role": "assistant", "content": CALL},
        *tool_messages,
        {"role": "assistant", "content": "The product is \\boxed{5535}."},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tools=env.tool_schemas(), tokenize=False)  # type: ignore[attr-defined]
    decoded = tokenizer.decode(list(trajectory.tokens), skip_special_tokens=False)  # type: ignore[attr-defined]
    assert decoded + "\n" == rendered  # the template's newline after the final <|im_end|> is never generated
    # The model's tokens are exactly what the engine produced, never re-tokenized.
    model_tokens = [t for s in trajectory.segments if s.origin is Origin.MODEL for t in s.tokens]
    expected = [
        t for turn in (CALL, "The product is \\boxed{5535}.<|im_end|>") for t in tokenizer.encode(turn)
    ]  # type: ignore[attr-defined]
    assert model_tokens == expected
    assert trajectory.loss_mask.sum() == len(expected)
    # The interrupted first turn became two segments: version 0, then version 1 after the resume.
    origins = [(s.origin.value, s.version) for s in trajectory.segments]
    assert origins == [("prompt", None), ("model", 0), ("model", 1), ("tool", None), ("model", 1)]
    assert driver.counts["resumed"] == 1
    assert engine.calls[1] == list(
        trajectory.tokens[: len(engine.calls[1])]
    )  # resumed with the accumulated tokens


async def test_weight_update_during_rollouts_changes_version_tags_once() -> None:
    tokenizer = tiny_tokenizer()
    model = build_tiny_moe(TinyMoEConfig(), tokenizer)
    engine = EmbeddedEngine(model, tokenizer)
    sampling = SamplingParams(max_new_tokens=40, temperature=1.0, seed=None)
    config = RolloutConfig(group_size=4, sampling=sampling, max_total_tokens=700)
    driver = RolloutDriver(engine, tokenizer, lambda: CodeMathEnv(tasks=[TASK]), config, num_experts=8)
    group = asyncio.ensure_future(driver.rollout_group(TASK))
    for _ in range(100_000):
        if engine._rows and len(engine._rows[0].tokens) >= 5:
            break
        await asyncio.sleep(0)
    new_weights = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    await engine.update_weights(new_weights, version=1)
    trajectories = await group
    await engine.aclose()
    spanning = [t for t in trajectories if tuple(t.versions) == (0, 1)]
    assert spanning, [t.versions for t in trajectories]
    for trajectory in spanning:
        versions = trajectory.token_versions[trajectory.loss_mask]
        switch = int((versions == 1).argmax())
        assert (versions[:switch] == 0).all() and (versions[switch:] == 1).all()
        assert trajectory.generation_staleness() > 0
        _, routes = trajectory.routed_experts()  # type: ignore[misc]
        assert routes.indices.shape == (trajectory.num_model_tokens, model.config.num_hidden_layers, 2)


async def test_64_concurrent_codemath_episodes_with_the_tiny_model() -> None:
    tokenizer = tiny_tokenizer()
    model = build_tiny_moe(TinyMoEConfig(), tokenizer)
    engine = EmbeddedEngine(model, tokenizer)
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, stop_strings=("</tool_call>",))
    config = RolloutConfig(group_size=8, sampling=sampling, max_total_tokens=512)
    driver = RolloutDriver(
        engine, tokenizer, lambda: CodeMathEnv(tasks="codemath-val"), config, num_experts=8
    )
    groups = await asyncio.gather(*(driver.rollout_group(task) for task in load_tasks("codemath-val")[:8]))
    await engine.aclose()
    trajectories = [t for group in groups for t in group]
    assert len(trajectories) == 64 and len({t.id for t in trajectories}) == 64
    assert sum(driver.counts[f"status:{s.value}"] for s in Status) == 64
    for trajectory in trajectories:
        assert trajectory.status in (Status.COMPLETED, Status.TRUNCATED)
        assert json.loads(json.dumps(trajectory.to_json())) == trajectory.to_json()


class FailingEngine(ScriptedEngine):
    async def generate(self, *args: object, **kwargs: object) -> Generation:
        raise RuntimeError("the server went away")


async def test_engine_failures_fail_the_trajectory_and_drop_the_group(tokenizer: object) -> None:
    driver = RolloutDriver(
        FailingEngine(tokenizer, []),
        tokenizer,
        lambda: CodeMathEnv(tasks=[TASK]),
        RolloutConfig(group_size=3, engine_retries=1),
    )
    assert await driver.rollout_group(TASK) == []
    assert driver.counts["dropped_groups"] == 1 and driver.counts["status:failed"] == 3
    keep = RolloutDriver(
        FailingEngine(tokenizer, []),
        tokenizer,
        lambda: CodeMathEnv(tasks=[TASK]),
        RolloutConfig(group_size=2, on_failure="keep"),
    )
    kept = await keep.rollout_group(TASK)
    assert [t.status for t in kept] == [Status.FAILED, Status.FAILED]
    assert kept[0].status_reason == "engine failed: the server went away"


async def test_prompt_longer_than_the_context_is_truncated(tokenizer: object) -> None:
    model = build_tiny_moe(TinyMoEConfig(), tokenizer)  # type: ignore[arg-type]
    engine = EmbeddedEngine(model, tokenizer, config=None)
    driver = RolloutDriver(
        engine, tokenizer, lambda: CodeMathEnv(tasks=[TASK]), RolloutConfig(group_size=1, max_total_tokens=50)
    )
    (trajectory,) = await driver.rollout_group(TASK)
    await engine.aclose()
    assert trajectory.status is Status.TRUNCATED and trajectory.status_reason == "context budget exhausted"
    with pytest.raises(ValueError, match="group_size"):
        RolloutConfig(group_size=0)
