"""Gymnasium spaces for chat: an action is the assistant's message text; an observation is the tuple
of new chat messages (system/user on reset, tool responses after a step)."""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import spaces

Message = dict[str, str]
"""One chat message: `role` and `content`, and `name` for tool responses."""

ROLES = ("system", "user", "assistant", "tool")
_SAMPLE_CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"


class UnicodeText(spaces.Space[str]):
    """Any Python string up to `max_length` characters (Gymnasium's `Text` only admits a fixed charset,
    and model output is arbitrary Unicode)."""

    def __init__(self, max_length: int = 1 << 20, seed: int | np.random.Generator | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_length = max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        length = int(self.np_random.integers(0, min(self.max_length, 64) + 1))
        picks = self.np_random.integers(0, len(_SAMPLE_CHARS), size=length)
        return "".join(_SAMPLE_CHARS[i] for i in picks)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"UnicodeText(max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnicodeText) and other.max_length == self.max_length


class ChatMessages(spaces.Space[tuple[Message, ...]]):
    """A tuple of chat messages, each a dict with a known `role` and a string `content`."""

    def __init__(self, max_messages: int = 64, seed: int | np.random.Generator | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_messages = max_messages
        self._text = UnicodeText()

    def sample(self, mask: Any = None, probability: Any = None) -> tuple[Message, ...]:
        self._text.np_random.bit_generator.state = self.np_random.bit_generator.state
        count = int(self.np_random.integers(1, 4))
        roles = self.np_random.choice(np.array(["system", "user", "tool"]), size=count)
        messages = tuple({"role": str(role), "content": self._text.sample()} for role in roles)
        self.np_random.bit_generator.state = self._text.np_random.bit_generator.state
        return messages

    def contains(self, x: Any) -> bool:
        return isinstance(x, tuple) and len(x) <= self.max_messages and all(is_message(m) for m in x)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"ChatMessages(max_messages={self.max_messages})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChatMessages) and other.max_messages == self.max_messages


def is_message(value: object) -> bool:
    """True for a well-formed chat message dict."""
    return (
        isinstance(value, dict)
        and value.get("role") in ROLES
        and isinstance(value.get("content"), str)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    )


def messages(*items: Message | Sequence[Message]) -> tuple[Message, ...]:
    """Flatten messages and lists of messages into an observation tuple."""
    out: list[Message] = []
    for item in items:
        out.extend([item] if isinstance(item, dict) else item)
    return tuple(out)
