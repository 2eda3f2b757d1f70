"""Helpers shared by the agents tests (imported from here, never from another test module)."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from pacerl.agents.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from pacerl.agents.engine.protocol import FinishReason, Generation, SamplingParams
from pacerl.agents.engine.sglang import SGLangEngine, SGLangOptions
from pacerl.agents.models import moe_info
from pacerl.agents.rollout import append_generation
from pacerl.agents.tokenizer import TokenizerFamily, default_corpus, tiny_tokenizer, train_tokenizer
from pacerl.agents.trajectory import Status, Trajectory
from tests.helpers import ThreadServer
from tests.scripted import ScriptedEngineBase
from tests.sglang_standin import create_standin_app


def tiny_moe(seed: int = 0, **overrides: Any) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128,
        max_position_embeddings=256, eos_token_id=1, pad_token_id=0, **overrides,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(config).eval()


def reference_greedy(model: Qwen3MoeForCausalLM, prompt: list[int], steps: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return [int(t) for t in out[0, len(prompt) :]]


LAYOUT = {"num_layers": 2, "top_k": 2, "num_experts": 8}


class StandIn:
    """A stand-in server over its own tiny MoE, and what a test needs to look inside it."""

    def __init__(self, tmp_path: Path, routed_experts: bool = True) -> None:
        self.model = tiny_moe()
        self.base = tmp_path / "base"
        self.model.config.save_pretrained(self.base)
        self.engine = EmbeddedEngine(self.model)
        app = create_standin_app(
            self.engine,
            model_path=str(self.base),
            weight_version="0",
            enable_return_routed_experts=routed_experts,
        )
        self.server = ThreadServer(app)
        self.url = self.server.url

    def client(self, **options: object) -> SGLangEngine:
        return SGLangEngine(SGLangOptions(url=self.url, **options))  # type: ignore[arg-type]

    async def wait_until(self, condition: Callable[[], bool], timeout_s: float = 30) -> None:
        """Poll `condition` (it reads the server's engine across threads) until it holds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return
            await asyncio.sleep(0.005)
        raise TimeoutError("the stand-in's engine did not get there")

    async def wait_for_tokens(self, count: int) -> None:
        """Until the server's first running request has `count` tokens."""
        await self.wait_until(lambda: bool(rows := list(self.engine._rows)) and len(rows[0].tokens) >= count)

    def hold_decoding_until_abort(self) -> tuple[threading.Event, list[str]]:
        """(may_decode, aborts): from now on the engine decodes only while `may_decode` is set, and
        every abort that reaches it is listed in `aborts` and sets `may_decode` again. A test clears
        `may_decode` once a request has the tokens it wants: from then on that request can end only
        by an abort, whatever the machine's speed (counting the tokens made in the meantime would
        measure the speed)."""
        engine = self.engine
        may_decode, aborts = threading.Event(), []
        may_decode.set()
        decode, abort = engine._decode, engine.abort

        def held_decode() -> None:
            if not may_decode.wait(timeout=60):
                may_decode.set()  # no abort came: decode on, the request ends by its length, the test fails
            decode()

        async def seen_abort(request_id: str) -> None:
            aborts.append(request_id)
            await abort(request_id)
            may_decode.set()

        engine._decode = held_decode  # type: ignore[method-assign]
        engine.abort = seen_abort  # type: ignore[method-assign]
        return may_decode, aborts


_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


TINY: dict[str, dict[str, Any]] = {
    "qwen2_moe": {
        "num_experts": 6,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "norm_topk_prob": False,  # Qwen1.5/2-MoE's own setting: un-renormalised top-k weights
    },
    "qwen3_moe": {"num_experts": 6, "moe_intermediate_size": 16, "norm_topk_prob": True},
    "mixtral": {"num_local_experts": 6, "router_jitter_noise": 0.0},
    "olmoe": {"num_experts": 6},
    "deepseek_v3": {
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,  # layer 0 dense, layers 1 and 2 MoE
        "moe_layer_freq": 1,  # DeepSeek-V3's config.json has it; SGLang reads it, transformers does not
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,  # group-limited top-k: 2 of 4 groups of 2 experts
        "n_shared_experts": 1,
        "moe_intermediate_size": 16,
        "num_key_value_heads": 4,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "routed_scaling_factor": 2.5,
    },
    "gpt_oss": {"num_local_experts": 6, "sliding_window": 64, "rope_parameters": _ROPE},
    "granitemoe": {"num_local_experts": 6},
}
"""Per family, what its tiny config adds to `common_sizes`: experts and family quirks."""


SAMPLING = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)


PROMPTS = [[5, 17, 40, 41, 9], [7, 8, 100, 101, 102, 103, 12]]


def common_sizes(vocab_size: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 256,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": None,
        "tie_word_embeddings": False,
        "output_router_logits": False,
    }


def build_tiny(
    family: str, seed: int = 0, tokenizer: PreTrainedTokenizerBase | None = None, **changes: Any
) -> PreTrainedModel:
    """A random tiny model of `family` in float32, its routers sharpened so no top-k sits on a near-tie
    (a tie could flip between a prefill and a cached decode in the last bit). Sized to `tiny_tokenizer()`,
    or to `tokenizer` with its pad and eos ids (a family's own: tests/pacerl/test_model_families.py);
    `changes` override config values (e.g. `max_position_embeddings`)."""
    sizes = common_sizes(len(tokenizer if tokenizer is not None else tiny_tokenizer()))
    if tokenizer is not None:
        sizes |= {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = AutoConfig.for_model(family, **{**sizes, **TINY.get(family, {}), **changes})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    assert isinstance(model, PreTrainedModel)
    for name, parameter in model.named_parameters():
        if name.endswith(("mlp.gate.weight", "mlp.router.weight", "block_sparse_moe.router.weight")):
            with torch.no_grad():
                parameter.mul_(25.0)
    model.train(False)
    return model


async def rollouts(engine_model: torch.nn.Module) -> list[Trajectory]:
    """One recorded generation per prompt, routes of every input asked for; rewards 1 and 0."""
    info = moe_info(engine_model)
    engine = EmbeddedEngine(engine_model, config=EmbeddedEngineConfig(seed=1))
    trajectories = []
    for index, prompt in enumerate(PROMPTS):
        trajectory = Trajectory.start(f"t{index}", "g", "task", prompt)
        started = time.time()
        out = await engine.generate(prompt, SAMPLING, return_routed_experts=True, routed_experts_start_len=0)
        append_generation(
            trajectory, out, num_experts=info.num_experts, started_at=started, ended_at=time.time()
        )
        trajectory.finish(
            Status.COMPLETED,
            reason="",
            reward=float(index % 2),
            completed_version=0,
            completed_at=time.time(),
        )
        trajectories.append(trajectory)
    await engine.aclose()
    return trajectories


def plain_routes(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    """`[positions, layers, top_k]`: the experts each router chooses in one plain forward over `tokens`."""
    info = moe_info(model)
    seen: dict[int, torch.Tensor] = {}

    def keep(layer: int) -> Any:
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            seen[layer] = output[2].detach()

        return hook

    handles = [gate.register_forward_hook(keep(layer)) for layer, gate in enumerate(info.gates)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens]))
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([seen[layer] for layer in range(info.num_layers)], dim=1).numpy()


UNSUPPORTED = "phimoe"
"""An MoE family of the installed transformers with no adapter (Mixtral-like, with its own router)."""


class ScriptedEngine(ScriptedEngineBase):
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

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, request_id: str | None = None,
        return_routed_experts: bool = False, session: str | None = None,
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


TEMPLATES = Path(__file__).parents[1] / "fixtures" / "templates"


QWEN_TOOLS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


FAMILIES = {
    "qwen2.5": TokenizerFamily(
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added_tokens=QWEN_TOOLS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=(TEMPLATES / "qwen2.5-instruct.jinja").read_text(),
    ),
    "qwen3": TokenizerFamily(
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added_tokens=(*QWEN_TOOLS, "<think>", "</think>"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=(TEMPLATES / "qwen3.jinja").read_text(),
    ),
    "llama3.1": TokenizerFamily(
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
            "<|finetune_right_pad_id|>",
        ),
        added_tokens=(),
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>",
        bos_token="<|begin_of_text|>",
        chat_template=(TEMPLATES / "llama3.1-instruct.jinja").read_text(),
    ),
}


@functools.cache
def family_tokenizer(name: str) -> Any:
    return train_tokenizer(default_corpus(per_env=40), vocab_cap=400, family=FAMILIES[name])


def tiny_dense(
    family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **changes: Any
) -> PreTrainedModel:
    """A random dense model of `family` in `dtype`, sized to `tiny_tokenizer()`, tied embeddings as in
    SmolLM2, RMSNorm weights, epsilon and rotary base moved off their defaults so a lost setting shows."""
    tokenizer = tiny_tokenizer()
    sizes: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-3,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
        "tie_word_embeddings": True,
    }
    config = AutoConfig.for_model(family, **{**sizes, **changes})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.uniform_(0.5, 1.5)
    assert isinstance(model, PreTrainedModel)
    model.train(False)
    return model
