"""The run config's keys, known without importing the library: `pacerl train loop.stepz=1` is refused in
a fraction of a second, before torch and transformers load (they take seconds), by reading the config
classes' source. The full check (types, ranges, the env and loss a key names) still runs when the config
is built (`pacerl.config.load_config`); this one only says which keys exist, so the two cannot disagree on
a key's spelling: `tests/pacerl/test_config_keys.py` holds every key of the built config to this reader.

    check_keys(read_settings(path), ["loop.stepz=1"])  # ConfigError: unknown key loop.stepz (known here: ...)

A config class is a dataclass in a module of pacerl; a field whose type is another config class is a
section, and a field typed as a mapping (or `Any`) takes any keys below it (an env's `settings`, a loss's
`options`). A class's `moved_keys` (keys of earlier versions) are accepted here, for the loader to
explain.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pacerl.settings import ConfigError, apply_overrides

FREE_FORM = {"dict", "Dict", "Mapping", "MutableMapping", "Any"}
"""Type names under which any key is allowed."""


@dataclass(frozen=True)
class Section:
    """The keys of one config class: each field's section (None: a value, or free-form below)."""

    name: str
    """The class, for messages."""
    fields: Mapping[str, Section | None]
    """Field name → its section when the field is a config class, else None."""
    free: frozenset[str]
    """Fields typed as mappings: any key below them."""
    moved: frozenset[str]
    """Keys of earlier versions (`moved_keys`), which the loader explains."""


def check_keys(data: Mapping[str, Any], overrides: Sequence[str] = ()) -> None:
    """ConfigError naming the first unknown key of `data` with `overrides` applied (`key=value`), as the
    full loader would name it; nothing else is checked here."""
    tree = apply_overrides(dict(data), overrides)
    _check(run_config_keys(), tree, "")


@functools.cache
def run_config_keys() -> Section:
    """The keys of `pacerl.config.RunConfig`, read from the source of its classes."""
    return _section("pacerl.config", "RunConfig")


def _check(section: Section, data: Any, prefix: str) -> None:
    if not isinstance(data, Mapping):
        return
    for key, value in data.items():
        if key in section.moved and key not in section.fields:
            continue
        if key not in section.fields:
            known = ", ".join(sorted(section.fields))
            raise ConfigError(f"config: unknown key {prefix}{key} (known here: {known})")
        child = section.fields[key]
        if child is not None and key not in section.free:
            _check(child, value, f"{prefix}{key}.")


def _section(module: str, name: str) -> Section:
    tree, imports = _parsed(module)
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if node is None:  # defined elsewhere and imported into `module`
        if name not in imports:
            raise LookupError(f"config class {name} is neither defined nor imported in {module}")
        return _section(*imports[name])
    fields: dict[str, Section | None] = {}
    free: set[str] = set()
    moved: set[str] = set()
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        annotation = ast.unparse(item.annotation)
        if annotation.startswith(("ClassVar", "typing.ClassVar")):
            if item.target.id == "moved_keys" and isinstance(item.value, ast.Dict):
                moved |= {
                    k.value
                    for k in item.value.keys
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)
                }
            continue
        names = _type_names(item.annotation)
        if names & FREE_FORM:
            free.add(item.target.id)
        fields[item.target.id] = _config_class(module, names)
    return Section(name, fields, frozenset(free), frozenset(moved))


def _config_class(module: str, names: set[str]) -> Section | None:
    """The section of the first config class among `names` (a dataclass defined in pacerl), else None."""
    tree, imports = _parsed(module)
    for type_name in sorted(names):
        where = (module, type_name) if _defines(tree, type_name) else imports.get(type_name)
        if where is not None and _is_dataclass(*where):
            return _section(*where)
    return None


def _type_names(annotation: ast.expr) -> set[str]:
    """Every simple name in a type annotation (`X | None`, `Optional[X]`, `"X"`, `a.X`)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return _type_names(ast.parse(annotation.value, mode="eval").body)
    names = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    return names


def _defines(tree: ast.Module, name: str) -> bool:
    return any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body)


def _is_dataclass(module: str, name: str) -> bool:
    tree, imports = _parsed(module)
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if node is None:
        return name in imports and _is_dataclass(*imports[name])
    return any("dataclass" in ast.unparse(decorator) for decorator in node.decorator_list)


@functools.cache
def _parsed(module: str) -> tuple[ast.Module, dict[str, tuple[str, str]]]:
    """A pacerl module's syntax tree (read, not imported) and its `from pacerl... import` names."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise LookupError(f"no source for {module}")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    imports = {
        alias.asname or alias.name: (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pacerl")
        for alias in node.names
    }
    return tree, imports
