"""Supervised warm start on generated tool-use demonstrations (docs/learnability.md's SFT recipe).

    demos = demonstrations("pacerl/CodeMath-v0", load_tasks("codemath-train"))
    losses = sft(model, demos, SFTConfig(steps=70))

A demonstration is tokenized exactly as the rollout driver (`pacerl.agents.rollout.RolloutDriver`) records the
same episode: the prompt is the rendered first turn with its generation prompt; each assistant turn is
what the model would generate (the content and the eos token, as one piece); each tool turn is the text
the template renders between that assistant message and the next generation prompt, tokenized once.
So the tokens a model is trained on are the tokens it later generates and is trained on by RL
(docs/learnability.md, pitfall 1: a whole-conversation tokenization can merge across the boundaries).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.nn import functional
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pacerl.envs import Message, Task
from pacerl.envs.chat_template import render_chat
from pacerl.envs.registry import env_class

IGNORE_INDEX = -100
"""Label of a token the loss skips (torch's cross-entropy default)."""


@dataclass(frozen=True)
class Demonstration:
    """One episode as the rollout driver would record it."""

    tokens: tuple[int, ...]
    """Prompt, generated and tool-turn tokens, in order."""
    loss_mask: tuple[bool, ...]
    """True on the tokens the model generates (each assistant turn and its closing eos token)."""
    task_id: str
    """The task the episode solves."""

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.loss_mask):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.loss_mask)} loss-mask entries")
        # The first token is never predicted, so a trainable demonstration needs a masked token after it.
        if not any(self.loss_mask[1:]):
            raise ValueError(f"demonstration {self.task_id!r} has no trained token after the first")


def render_demonstration(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]] | None = None,
) -> tuple[list[int], list[bool]]:
    """`(tokens, loss_mask)` of a conversation, segment by segment as the rollout driver records it.

    `messages`: the env's first observation (system and user), then assistant messages, each but the
    last followed by the env's tool messages; the last is the final answer. `tools`: the schemas the
    driver renders into the system turn (None when `tool_schemas_in_prompt` is off).
    """
    eos = tokenizer.eos_token
    if not isinstance(eos, str) or not eos:
        raise ValueError("the tokenizer needs an eos token (the end of a generated turn)")
    tools = list(tools) if tools else None
    # The driver's probe: what the template writes after an assistant message's content. A model that
    # stops on eos has emitted the eos token itself; the rest of the tail opens the next tool turn.
    probe = _render(tokenizer, [{"role": "assistant", "content": "\x00"}], None, generation_prompt=False)
    tail = probe[probe.index("\x00") + 1 :]
    if not tail.startswith(eos):
        raise ValueError(f"the chat template closes an assistant message with {tail!r}, not with {eos!r}")
    closing = tail.removeprefix(eos)

    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise ValueError("a demonstration needs prompt messages followed by an assistant message")
    if messages[-1]["role"] != "assistant":
        raise ValueError("a demonstration ends with the final assistant message (the answer)")
    history = list(messages[:first])
    tokens = _encode(tokenizer, _render(tokenizer, history, tools, generation_prompt=True))
    mask = [False] * len(tokens)
    index = first
    while index < len(messages):
        assistant = messages[index]
        generated = _encode(tokenizer, assistant["content"] + eos)
        decoded = tokenizer.decode(generated, skip_special_tokens=False)
        if decoded != assistant["content"] + eos:  # the driver hands the env the decoded text
            raise ValueError(f"assistant message {index} does not survive encode/decode: {decoded!r}")
        tokens += generated
        mask += [True] * len(generated)
        history.append(assistant)
        following = index + 1
        while following < len(messages) and messages[following]["role"] != "assistant":
            following += 1
        observation = list(messages[index + 1 : following])
        if following < len(messages) and not observation:
            raise ValueError(f"assistant message {index} is not the last, yet no tool turn follows it")
        if observation:
            before = _render(tokenizer, history, tools, generation_prompt=False)
            after = _render(tokenizer, [*history, *observation], tools, generation_prompt=True)
            if not after.startswith(before):
                raise ValueError("the chat template is not prefix-stable")
            tool_turn = _encode(tokenizer, closing + after[len(before) :])
            tokens += tool_turn
            mask += [False] * len(tool_turn)
            history += observation
        index = following
    return tokens, mask


def demonstrations(
    env_id: str,
    tasks: Sequence[Task],
    *,
    seed: int = 0,
    style: str | None = None,
    system_prompt: str | None = "",
    tool_schemas: bool = False,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> list[Demonstration]:
    """One demonstration per task of `env_id` (any registered `ToolEnv` that writes demonstrations: its
    `demonstration(task, style, rng)` turns after its `initial_messages(task)`), rendered as the env and
    the driver would with `ToolEnvConfig(system_prompt=system_prompt)` (None: the env's own prompt,
    "": none) and `RolloutConfig(tool_schemas_in_prompt=tool_schemas)`. `style`: one of the env's
    `warm_start_steps` that is no curriculum (`warm_start_stages`; None: the first such).

    Deterministic: a task's demonstration depends only on `seed` and the task (not on its neighbours).
    `tokenizer` defaults to `pacerl.agents.tokenizer.tiny_tokenizer()`.
    """
    cls = env_class(env_id)
    if not cls.warm_start_steps:
        raise ValueError(f"{env_id} writes no demonstrations (its class sets no warm_start_steps)")
    style = style or next(s for s in cls.warm_start_steps if s not in cls.warm_start_stages)
    if style not in cls.warm_start_steps:
        raise ValueError(f"{env_id} writes {', '.join(cls.warm_start_steps)} demonstrations, not {style!r}")
    if style in cls.warm_start_stages:
        stages = ", ".join(cls.warm_start_stages[style])
        raise ValueError(f"{env_id}'s {style!r} is a curriculum of {stages}: demonstrate each of those")
    if not tasks:
        raise ValueError("no tasks to demonstrate")
    if tokenizer is None:
        from pacerl.agents.tokenizer import tiny_tokenizer  # late: trains the tokenizer on first use

        tokenizer = tiny_tokenizer()
    config = replace(cls.default_config(), system_prompt=system_prompt)
    env = cls(tasks=list(tasks), config=config)
    try:
        tools = (env.tool_schemas() if tool_schemas else None) or None
        demos = []
        for task in tasks:
            # A string seed hashes stably (sha512), so the draw is per task, not per position in `tasks`.
            rng = random.Random(f"{seed}/{task.id}")
            turns = env.demonstration(task, style, rng)
            tokens, mask = render_demonstration(tokenizer, [*env.initial_messages(task), *turns], tools)
            demos.append(Demonstration(tuple(tokens), tuple(mask), task.id))
    finally:
        env.close()
    return demos


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    tools: list[dict[str, Any]] | None,
    *,
    generation_prompt: bool,
) -> str:
    return render_chat(tokenizer, messages, tools, generation_prompt=generation_prompt)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


# -- training ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning on demonstrations. The defaults are docs/learnability.md's recipe: about 70
    steps leave the tiny MoE at 30–50% greedy accuracy on CodeMath, the RL warm start it recommends."""

    lr: float = 2e-3
    """Peak AdamW learning rate (betas 0.9/0.99)."""
    warmup_steps: int = 50
    """Steps of linear warm-up from lr/warmup_steps to lr; constant afterwards (0: none)."""
    batch_size: int = 64
    """Demonstrations per step, drawn without replacement within each pass over the set."""
    steps: int = 70
    """Optimizer steps (`on_step` may stop earlier)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    grad_clip: float = 1.0
    """Largest global gradient norm (0 disables clipping)."""
    seed: int = 0
    """Seed of the batch order."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.batch_size < 1 or self.steps < 1:
            raise ValueError("warmup_steps >= 0, batch_size >= 1 and steps >= 1 are required")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("weight_decay and grad_clip must be >= 0")


def sft(
    model: PreTrainedModel,
    demos: Sequence[Demonstration],
    config: SFTConfig | None = None,
    *,
    on_step: Callable[[int, float], bool] | None = None,
) -> list[float]:
    """Train `model` in place on `demos`: the mean next-token cross-entropy over the masked (generated)
    tokens of each right-padded batch. Returns the per-step losses.

    `on_step(step, loss)` runs after each update (`step` counts from 0); returning True stops training.
    The model is in train mode during and in eval mode after, also on an error. Torch's thread count is
    the caller's.
    """
    config = config or SFTConfig()
    if not demos:
        raise ValueError("no demonstrations to train on")
    pad_id = model.config.pad_token_id
    if pad_id is None:
        raise ValueError("the model's config has no pad_token_id")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=(0.9, 0.99), weight_decay=config.weight_decay
    )
    warmup = config.warmup_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    batches = _batches(len(demos), config.batch_size, generator)
    losses: list[float] = []
    model.train(True)
    try:
        for step in range(config.steps):
            input_ids, labels = _collate([demos[i] for i in next(batches)], int(pad_id))
            # Position t predicts token t+1. No position before the batch's first trained target needs
            # its logits: the prompts, most of a demonstration, skip the vocabulary projection.
            start = int((labels[:, 1:] != IGNORE_INDEX).any(dim=0).nonzero()[0])
            predicting = torch.arange(start, input_ids.shape[1] - 1, device=device)
            # No attention mask: with right padding a causal model's real tokens never see the padding
            # after them, so their logits are the same, and SDPA's unmasked causal path is ~15% faster.
            logits = model(input_ids=input_ids.to(device), use_cache=False, logits_to_keep=predicting).logits
            # The mean runs over the masked targets of the whole batch.
            loss = functional.cross_entropy(
                logits.flatten(0, 1).float(),
                labels[:, start + 1 :].flatten().to(device),
                ignore_index=IGNORE_INDEX,
            )
            optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)  # Tensor.backward is untyped in torch's stubs
            if config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
            if on_step is not None and on_step(step, losses[-1]):
                break
    finally:
        model.train(False)  # eval(), which transformers leaves untyped
    return losses


def _batches(count: int, batch_size: int, generator: torch.Generator) -> Iterator[list[int]]:
    """Indices of successive batches: passes over a fresh permutation each, joined across passes."""
    pending: list[int] = []
    while True:
        while len(pending) < batch_size:
            pending += torch.randperm(count, generator=generator).tolist()
        yield pending[:batch_size]
        pending = pending[batch_size:]


def _collate(batch: Sequence[Demonstration], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `(input_ids, labels)`, each `[batch, longest]`; labels are IGNORE_INDEX off the loss
    mask and on padding. Right padding keeps each token's position id what it is at generation time."""
    width = max(len(demo.tokens) for demo in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    for row, demo in enumerate(batch):
        tokens = torch.tensor(demo.tokens, dtype=torch.long)
        mask = torch.tensor(demo.loss_mask, dtype=torch.bool)
        input_ids[row, : len(tokens)] = tokens
        labels[row, : len(tokens)] = torch.where(mask, tokens, IGNORE_INDEX)
    return input_ids, labels
