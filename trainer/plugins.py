"""What a user's module adds to pacerl by name, as `module:name` (a loss, a filter)."""

from __future__ import annotations

import importlib


def imported_attribute(what: str, module: str, attribute: str) -> object | None:
    """`module`'s `attribute`, the module imported first (None if it has no such attribute, e.g. when
    importing it registered the name instead); a ValueError naming `what` if it cannot be imported."""
    if not module or not attribute:
        raise ValueError(f"{what}: the form is module:name")
    try:
        loaded = importlib.import_module(module)
    except ImportError as error:
        raise ValueError(f"{what}: cannot import module {module!r}: {error}") from None
    return getattr(loaded, attribute, None)
