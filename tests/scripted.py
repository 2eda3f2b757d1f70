"""A base for scripted engines in tests: everything of the engine protocol but `generate`."""

from __future__ import annotations

from collections.abc import Mapping

import torch


class ScriptedEngineBase:
    """A scripted policy through the engine protocol: subclasses write `generate`; weight updates only
    move the version, and there is nothing to abort or close."""

    _version = 0

    @property
    def version(self) -> int:
        return self._version

    async def abort(self, request_id: str) -> None:
        return None

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._version = version

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None
