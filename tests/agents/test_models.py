"""The tiny MoE and its tokenizer: shapes, determinism, checkpoints, router layout, and the tokenizer
properties token-exact multi-turn rollouts rely on (single-token digits and specials, byte-level round
trip, piecewise encoding equal to whole encoding)."""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pacerl.agents.models import (
    FAMILIES,
    Family,
    MoEInfo,
    TinyMoEConfig,
    build_tiny_moe,
    load_model,
    moe_info,
    parameter_count,
    save_model,
)
from pacerl.agents.tokenizer import ADDED_TOKENS, CONTROL_TOKENS, TOOL_TOKENS, tiny_tokenizer, train_tokenizer
from pacerl.envs import code_math
from pacerl.envs.code_math import CodeMathEnv
from pacerl.envs.spaces import Message
from pacerl.envs.tasks import Task


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # Forwards this small gain nothing from a second thread, and when another process holds a core,
    # OpenMP's waiting made them up to 50x slower. Restored, so other modules keep their setting.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def models(tokenizer: PreTrainedTokenizerBase) -> dict[str, PreTrainedModel]:
    return {family: build_tiny_moe(TinyMoEConfig(family=family), tokenizer) for family in FAMILIES}


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Message],
    schemas: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    text = tokenizer.apply_chat_template(
        messages,
        tools=list(schemas) if schemas else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )
    assert isinstance(text, str)
    return text


def tools() -> list[dict[str, Any]]:
    env = CodeMathEnv(tasks=[Task("t", "What is 482 * 93?", ("44826",))])
    return env.tool_schemas()


def call(code: str) -> str:
    return '<tool_call>{"name": "python", "arguments": {"code": "' + code + '"}}</tool_call>'


CODEMATH: list[Message] = [
    {"role": "system", "content": code_math.SYSTEM_PROMPT},
    {"role": "user", "content": "What is 482 * 93?"},
    {"role": "assistant", "content": call("print(482 * 93")},
    {"role": "tool", "content": "SyntaxError: '(' was never closed"},
    {"role": "assistant", "content": "Fixing it.\n" + call("print(482 * 93)")},
    {"role": "tool", "content": "44826"},
    {"role": "assistant", "content": "\\boxed{44826}"},
]
"""A CodeMath episode: a failed call, a fixed one, and the answer."""


# -- tokenizer -----------------------------------------------------------------------------------------


def test_added_tokens_are_single_ids_and_tool_tags_survive_skip_special(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    for expected_id, token in enumerate(ADDED_TOKENS):
        assert encode(tokenizer, token) == [expected_id]
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|pad|>", "<|im_end|>")
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 2)
    ids = encode(tokenizer, "<|im_start|>assistant\n" + call("print(1)") + "<|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n" + call("print(1)")
    assert set(CONTROL_TOKENS) <= set(tokenizer.all_special_tokens)
    assert not set(TOOL_TOKENS) & set(tokenizer.all_special_tokens)


def test_every_digit_is_its_own_token(tokenizer: PreTrainedTokenizerBase) -> None:
    digit_ids = [encode(tokenizer, digit) for digit in "0123456789"]
    assert all(len(ids) == 1 for ids in digit_ids)
    ids = encode(tokenizer, "What is 4820 * 93 + 100?\\boxed{44826}")
    tokens = tokenizer.convert_ids_to_tokens(ids)
    digits = [token for token in tokens if any(ch.isdigit() for ch in token)]
    assert digits == list("48209310044826")


def test_the_default_corpus_makes_the_tool_call_boilerplate_short(tokenizer: PreTrainedTokenizerBase) -> None:
    vocab_size = len(tokenizer)
    print(f"tiny tokenizer: {vocab_size} ids")
    assert 300 < vocab_size <= 512
    assert len(encode(tokenizer, call("print("))) <= 10
    assert len(encode(tokenizer, "\\boxed{")) == 1


@pytest.mark.parametrize(
    "text",
    [
        "",
        "plain ascii",
        "emoji 🎉👩‍👩‍👧 and CJK 数学 and ümlauts, combining e\u0301",
        "NUL\x00 and other controls \x01\x7f\t\r\n",
        "  leading and trailing spaces  \n\n\n",
        "half a special <|im_ and <tool_ call> </tool_call",
        "a\u2028line separator and \ufeff BOM and \U0010ffff",
    ],
)
def test_byte_level_round_trip(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = encode(tokenizer, text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_byte_level_round_trip_on_any_text(text: str) -> None:
    tokenizer = _cached_tokenizer()
    assert tokenizer.decode(encode(tokenizer, text)) == text


@functools.cache
def _cached_tokenizer() -> PreTrainedTokenizerBase:
    # hypothesis forbids function-scoped fixtures; one tokenizer for all examples keeps it fast.
    return tiny_tokenizer()


def test_chat_template_renders_tool_schemas(tokenizer: PreTrainedTokenizerBase) -> None:
    schemas = tools()
    text = render(tokenizer, CODEMATH[:2], schemas, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n" + code_math.SYSTEM_PROMPT + "\n\n# Tools\n")
    assert '"name": "python"' in text and "<tools>\n{" in text and "\n</tools>" in text
    assert text.endswith("<|im_start|>user\nWhat is 482 * 93?<|im_end|>\n<|im_start|>assistant\n")
    tokenized = tokenizer.apply_chat_template(
        CODEMATH[:2], tools=list(schemas), add_generation_prompt=True, return_dict=False
    )
    assert tokenized == encode(tokenizer, text)
    full = render(tokenizer, CODEMATH, schemas)
    assert "<|im_start|>user\n<tool_response>\n44826\n</tool_response><|im_end|>\n" in full


def _message_pieces(tokenizer: PreTrainedTokenizerBase, messages: list[Message], schemas: Any) -> list[str]:
    """The full rendering cut after every message, and after each assistant turn's header (where the
    engine starts generating), as a rollout appends them."""
    full = render(tokenizer, messages, schemas)
    cuts = {0, len(full)}
    for count in range(1, len(messages)):
        prefix = render(tokenizer, messages[:count], schemas)
        assert full.startswith(prefix)
        cuts.add(len(prefix))
        if messages[count]["role"] == "assistant":
            header = render(tokenizer, messages[:count], schemas, add_generation_prompt=True)
            assert full.startswith(header)
            # The generated ids end at <|im_end|>; the template's "\n" after it comes with the next turn.
            cuts |= {len(header), len(header) + len(messages[count]["content"] + "<|im_end|>")}
    ordered = sorted(cuts)
    return [full[start:end] for start, end in itertools.pairwise(ordered)]


def test_encoding_piece_by_piece_equals_encoding_whole(tokenizer: PreTrainedTokenizerBase) -> None:
    schemas = tools()
    full = render(tokenizer, CODEMATH, schemas)
    pieces = _message_pieces(tokenizer, CODEMATH, schemas)
    # 6 message boundaries, and each of the 3 assistant turns adds its header and its <|im_end|>.
    assert "".join(pieces) == full and len(pieces) == 1 + 6 + 2 * 3
    assert [token for piece in pieces for token in encode(tokenizer, piece)] == encode(tokenizer, full)


def test_no_merge_crosses_a_newline_or_an_added_token(tokenizer: PreTrainedTokenizerBase) -> None:
    # Cut at every newline and added token, on both sides: a harder version of message boundaries,
    # which also covers consecutive tool responses sharing one user turn.
    messages = [*CODEMATH[:3], {"role": "tool", "content": "1\n2"}, {"role": "tool", "content": "x = 3"}]
    full = render(tokenizer, messages, tools(), add_generation_prompt=True)
    boundary = "|".join(re.escape(token) for token in ("\n", *ADDED_TOKENS))
    pieces = [piece for piece in re.split(f"({boundary})", full) if piece]
    assert len(pieces) > 40
    assert [token for piece in pieces for token in encode(tokenizer, piece)] == encode(tokenizer, full)


def test_training_is_deterministic_and_checks_its_cap() -> None:
    texts = [f"<|im_start|>user\nWhat is {n} * {n + 7}?<|im_end|>\n" for n in range(300)]
    first, second = train_tokenizer(texts, vocab_cap=300), train_tokenizer(texts, vocab_cap=300)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert len(first) <= 300
    assert tiny_tokenizer().get_vocab() == tiny_tokenizer().get_vocab()
    with pytest.raises(ValueError, match="vocab_cap must be >= 263"):
        train_tokenizer(texts, vocab_cap=100)


# -- models --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_builds_with_the_expected_size(family: Family, tokenizer: PreTrainedTokenizerBase) -> None:
    model = build_tiny_moe(TinyMoEConfig(family=family), tokenizer)
    count = parameter_count(model)
    assert 1_800_000 <= count <= 2_000_000
    assert not model.training
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}
    assert model.config.model_type == family
    assert model.config.vocab_size == len(tokenizer)
    assert (model.config.pad_token_id, model.config.eos_token_id) == (0, 2)
    assert model.config._experts_implementation == "grouped_mm"
    assert model.config.router_aux_loss_coef == 0.0 and not model.config.output_router_logits


def test_same_seed_same_weights_and_the_callers_rng_is_untouched(tokenizer: PreTrainedTokenizerBase) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = build_tiny_moe(TinyMoEConfig(seed=7), tokenizer).state_dict()
    assert torch.equal(torch.rand(3), expected_next)
    second = build_tiny_moe(TinyMoEConfig(seed=7), tokenizer).state_dict()
    other = build_tiny_moe(TinyMoEConfig(seed=8), tokenizer).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not torch.equal(first["model.layers.0.mlp.gate.weight"], other["model.layers.0.mlp.gate.weight"])


def test_builds_in_float32_whatever_the_default_dtype(tokenizer: PreTrainedTokenizerBase) -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = build_tiny_moe(TinyMoEConfig(num_layers=1), tokenizer)
    finally:
        torch.set_default_dtype(previous)
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"family": "llama"}, "family must be one of"),
        ({"num_kv_heads": 3}, "must divide num_heads"),
        ({"top_k": 9}, "top_k .* must be <= num_experts"),
        ({"hidden_size": 0}, "hidden_size must be >= 1"),
        ({"head_dim": 31}, "head_dim must be even"),
        ({"experts_implementation": "magic"}, "unknown experts_implementation"),
    ],
)
def test_config_rejects_bad_shapes(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TinyMoEConfig(**change)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_and_generate_on_a_rendered_prompt(
    family: str, models: dict[str, PreTrainedModel], tokenizer: PreTrainedTokenizerBase
) -> None:
    model: Any = models[family]  # generate() comes from GenerationMixin, which the annotation lacks
    prompt = render(tokenizer, CODEMATH[:2], tools(), add_generation_prompt=True)
    ids = torch.tensor([encode(tokenizer, prompt)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False
    )
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 4
    assert torch.equal(out[0, : ids.shape[1]], ids[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_load_round_trip(
    family: str, models: dict[str, PreTrainedModel], tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    model = models[family]
    directory = save_model(model, tokenizer, tmp_path / "checkpoint")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in directory.iterdir()}
    loaded, loaded_tokenizer = load_model(directory)
    assert type(loaded) is type(model) and not loaded.training
    assert loaded.config._experts_implementation == "grouped_mm"
    text = render(tokenizer, CODEMATH, tools())
    assert encode(loaded_tokenizer, text) == encode(tokenizer, text)
    assert render(loaded_tokenizer, CODEMATH, tools()) == text
    text = render(tokenizer, CODEMATH)  # without the schemas: short, so the forwards stay fast
    assert (loaded_tokenizer.eos_token_id, loaded_tokenizer.pad_token_id) == (2, 0)
    assert encode(loaded_tokenizer, "<tool_call>") == [3]
    ids = torch.tensor([encode(tokenizer, text)])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_load_model_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint directory at"):
        load_model(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        load_model(tmp_path / "empty")
    (tmp_path / "weightless").mkdir()
    (tmp_path / "weightless" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_model(tmp_path / "weightless")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file"):
        load_model(tmp_path / "file")
    with pytest.raises(FileNotFoundError, match="could not be loaded from the Hugging Face hub"):
        load_model("pacerl-tests/no-such-model", local_files_only=True)


# -- routers -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_info_finds_every_gate(family: str, models: dict[str, PreTrainedModel]) -> None:
    model = models[family]
    info = moe_info(model)
    assert isinstance(info, MoEInfo)
    assert (info.family, info.num_layers, info.num_experts, info.top_k) == (family, 4, 8, 2)
    assert info.layers == (0, 1, 2, 3)
    layers: Any = model.model.layers
    assert info.gates == tuple(layer.mlp.gate for layer in layers)
    assert info.gates == tuple(model.get_submodule(name) for name in info.gate_names)
    assert moe_info(model.model).num_layers == 4


def test_moe_info_rejects_models_without_routers() -> None:
    with pytest.raises(ValueError, match="knows the MoE families"):
        moe_info(torch.nn.Linear(2, 2))


Hook = Callable[[torch.nn.Module, Any, Any], Any]


def _forward_with(model: PreTrainedModel, ids: torch.Tensor, hooks: list[Hook]) -> torch.Tensor:
    gates = moe_info(model).gates
    handles = [gate.register_forward_hook(hook) for gate, hook in zip(gates, hooks, strict=True)]
    try:
        with torch.no_grad():
            logits: torch.Tensor = model(input_ids=ids).logits
        return logits
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("family", FAMILIES)
def test_gate_outputs_as_documented_and_a_hook_can_replay_them(
    family: str, models: dict[str, PreTrainedModel], tokenizer: PreTrainedTokenizerBase
) -> None:
    model = models[family]
    info = moe_info(model)
    ids = torch.tensor([encode(tokenizer, "What is 482 * 93?"), encode(tokenizer, "What is 512 * 64?")])
    tokens = ids.numel()
    recorded: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def record(module: torch.nn.Module, args: Any, output: Any) -> None:
        recorded.append(output)

    baseline = _forward_with(model, ids, [record] * info.num_layers)
    assert len(recorded) == info.num_layers
    for logits, scores, indices in recorded:
        assert logits.shape == (tokens, info.num_experts) and logits.dtype == torch.float32
        assert scores.shape == indices.shape == (tokens, info.top_k) and indices.dtype == torch.int64
        assert torch.allclose(scores.sum(-1), torch.ones(tokens))
        top = torch.softmax(logits.float(), -1).topk(info.top_k, dim=-1)
        assert torch.equal(indices, top.indices)
        assert torch.allclose(scores, top.values / top.values.sum(-1, keepdim=True))

    def replay(layer: int) -> Hook:
        return lambda module, args, output: recorded[layer]

    replayed = _forward_with(model, ids, [replay(layer) for layer in range(info.num_layers)])
    assert torch.equal(replayed, baseline)

    def force_first_experts(module: torch.nn.Module, args: Any, output: Any) -> Any:
        logits, _, indices = output
        forced = torch.arange(info.top_k).expand_as(indices).contiguous()
        return logits, torch.full(indices.shape, 1 / info.top_k), forced

    forced = _forward_with(model, ids, [force_first_experts] * info.num_layers)
    assert not torch.allclose(forced, baseline)
