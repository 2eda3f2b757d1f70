"""What a user's module adds to pacerl by name, as `module:NAME` (a policy loss, a staleness filter):
the registry both kinds live in, and how the chosen one's settings are read from a config section."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """Entries by name: the built-ins, what a module adds with `register`, and `module:NAME` (`lookup`
    imports the module; NAME is an attribute of it, or a name its import registered)."""

    def __init__(self, kind: str, accept: Callable[[object], T | None], expected: str) -> None:
        super().__init__()
        self.kind = kind
        """What an entry is, in messages ("loss", "filter")."""
        self.accept = accept
        """The entry a module's attribute stands for, or None when it is not one."""
        self.expected = expected
        """What a module's attribute must be, in messages ("a StalenessFilter")."""

    def register(self, name: str, entry: T) -> None:
        """Make `entry` usable as `name` (a module that registers is named `module:name`, so that it is
        imported first)."""
        if not name or ":" in name:
            raise ValueError(f"a {self.kind} is registered under a non-empty name without ':', got {name!r}")
        if self.accept(entry) is not entry:
            raise ValueError(f"a {self.kind} registered as {name!r} must be {self.expected}, got {entry!r}")
        if name in self and self[name] is not entry:
            raise ValueError(f"a different {self.kind} is registered as {name!r} already")
        self[name] = entry

    def lookup(self, name: str) -> T:
        """The entry named `name`; a ValueError that says what is wrong."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name is a non-empty string, got {name!r}")
        module, sep, attribute = name.rpartition(":")
        if not sep:
            if name in self:
                return self[name]
            raise ValueError(
                f"{self.kind} name must be one of {', '.join(self)} or module:name (a user's "
                f"{self.kind}), got {name!r}"
            )
        what = f"{self.kind} {name!r}"
        if not module or not attribute:
            raise ValueError(f"{what}: the form is module:name")
        try:
            loaded = importlib.import_module(module)
        except ImportError as error:
            raise ValueError(f"{what}: cannot import module {module!r}: {error}") from None
        found = getattr(loaded, attribute, None)
        if found is None and attribute in self:
            return self[attribute]
        entry = self.accept(found)
        if entry is None:
            raise ValueError(
                f"{what}: {module}.{attribute} is not {self.expected} nor a registered {self.kind} name "
                f"(got {found!r})"
            )
        return entry


class Configurable(Protocol):
    """What `chosen_settings` reads of an entry: where its settings live."""

    @property
    def settings(self) -> type | None: ...

    @property
    def section(self) -> str: ...


def chosen_settings(
    config: object, name: str, entry: Configurable, options: Mapping[str, Any], where: str
) -> Any:
    """The settings of `entry`, chosen as `name` in `config` (a config section): its own section of
    `config` for a built-in, else its settings class built from `options` (`where` names that key, e.g.
    `filter.options`), or None for an entry without settings. ValueError when `options` do not fit."""
    if entry.section:
        if options:
            section = f"{where.rpartition('.')[0]}.{entry.section}"
            raise ValueError(f"{name!r} takes {section}, not {where}")
        return getattr(config, entry.section)
    if entry.settings is None:
        if options:
            raise ValueError(f"{name!r} takes no options, but {where} are given")
        return None
    try:
        return entry.settings(**options)
    except TypeError as error:
        raise ValueError(f"{where} do not fit {entry.settings.__name__}: {error}") from None
