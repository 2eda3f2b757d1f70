"""Helpers shared by the pacerl tests (imported from here, never from another test module)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pacerl.agents.engine.protocol import FinishReason, Generation, SamplingParams
from tests.scripted import ScriptedEngineBase


class TextEngine(ScriptedEngineBase):
    """Answers each prompt with `reply(decoded prompt)` and the end-of-sequence token; keeps every prompt."""

    def __init__(self, tokenizer: Any, reply: Callable[[str], str]) -> None:
        self.tokenizer, self.reply = tokenizer, reply
        self.prompts: list[str] = []

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, **_: Any) -> Generation:
        prompt = self.tokenizer.decode(list(input_ids), skip_special_tokens=False)
        self.prompts.append(prompt)
        text = self.reply(prompt)
        tokens = (*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id)
        return Generation(tokens, (-0.25,) * len(tokens), (0,) * len(tokens), FinishReason.STOP)
