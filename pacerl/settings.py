"""The project's one config loader. A config is a tree of frozen dataclasses, each with its own defaults
and range checks (`__post_init__`); this module reads one from TOML or JSON plus dotted `key=value`
overrides, validates it with pydantic (unknown keys and wrong types are errors that name the key), and
writes it back as plain JSON. The run's config (`pacerl.config.RunConfig`) and the simulator's
(`pacerl.lab.config.SimConfig`) are both read through it. It imports none of the project, so a command
can check a config file before it imports torch.

    data = apply_overrides(read_settings(Path("my.toml")), ["loop.steps=50"])
    config = settings_into(RunConfig(), data)
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pydantic

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem, worded for the person who wrote the config."""


def read_settings(path: Path) -> dict[str, Any]:
    """The table of settings in `path`: TOML for a `.toml` file, JSON otherwise. ConfigError when it
    cannot be read, does not parse, or holds something other than a table."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read the config {path}: {error.strerror}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"config {path} does not parse: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must hold a table of settings")
    return data


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`data` with each `key=value` of `overrides` set in place, in order: dotted keys reach into
    sections, values are parsed as JSON when they parse and kept as strings otherwise."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value (e.g. loop.steps=50)")
        _set(data, key.strip().split("."), _parse_value(raw))
    return data


def settings_into(base: T, data: Mapping[str, Any], *, unknown: str = "key") -> T:
    """`base` (a config dataclass) with the settings of `data` applied: what `data` leaves out keeps
    `base`'s value (a section given in part keeps its other values); lists become tuples and the string
    "inf" an infinite float. ConfigError on an unknown key ("unknown `unknown` a.b", the noun being the
    caller's), a wrong type or a value its dataclass refuses, naming the key."""
    cls = type(base)
    _check_keys(cls, data, "", unknown)
    merged = merge_settings(config_to_dict(base), data)
    try:
        validated: T = pydantic.TypeAdapter(cls).validate_python(merged)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise ConfigError(_located(where, message)) from None
    return validated


def _located(where: str, message: str) -> str:
    """A validation message placed at the key `where`, without repeating what the message names already:
    a section's own check may name the key in full ("workload.group_size must be ...") or from the
    section's own name ("max_age.versions must be ..." at `filter.max_age`)."""
    if not where or message.startswith(f"{where}."):
        return message
    parent, _, section = where.rpartition(".")
    if message.startswith(f"{section}."):
        return f"{parent}.{message}" if parent else message
    return f"{where}: {message}"


def config_to_dict(config: Any) -> Any:
    """A dataclass tree as plain JSON types; infinities become the strings "inf" and "-inf" (standard
    JSON has no infinity), which `settings_into` reads back."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: config_to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, tuple | list):
        return [config_to_dict(v) for v in config]
    if isinstance(config, Mapping):
        return {str(k): config_to_dict(v) for k, v in config.items()}
    if isinstance(config, float) and math.isinf(config):
        return "inf" if config > 0 else "-inf"
    return config


def merge_settings(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `changes` laid over it, section by section (a section given in part keeps the rest
    of `base`'s)."""
    merged = dict(base)
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_settings(merged[key], value)
        else:
            merged[key] = value
    return merged


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _set(data: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        child = data.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override sets {'.'.join(keys)} inside {key!r}, which is not a section")
        data = child
    data[keys[-1]] = value


def _check_keys(cls: type, data: Any, prefix: str, noun: str) -> None:
    """Unknown keys anywhere in the tree are errors (pydantic would drop them silently)."""
    if not isinstance(data, Mapping):
        return
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    # A config class may list keys of earlier versions and where they went (`moved_keys`), e.g. the loss
    # knobs that moved into per-loss sections; a key that became a section is moved when given a value.
    moved: Mapping[str, str] = getattr(cls, "moved_keys", {})
    for key, value in data.items():
        nested = _dataclass_in(hints[key]) if key in known else None
        if key in moved and (key not in known or (nested is not None and not isinstance(value, Mapping))):
            raise ConfigError(f"{prefix}{key} moved to {_prefixed(prefix, moved[key])}")
        if key not in known:
            raise ConfigError(f"unknown {noun} {prefix}{key} (known here: {', '.join(sorted(known))})")
        if nested is not None:
            _check_keys(nested, value, f"{prefix}{key}.", noun)


def _prefixed(prefix: str, places: str) -> str:
    """`places` ("a.b or c.d") with each place under `prefix`."""
    return " or ".join(prefix + place for place in places.split(" or "))


def _dataclass_in(hint: Any) -> type | None:
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        found = [c for c in typing.get_args(hint) if dataclasses.is_dataclass(c) and isinstance(c, type)]
        return found[0] if found else None
    return None
