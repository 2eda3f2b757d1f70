"""A byte-level BPE tokenizer trained offline in about a second, for the tiny MoE (docs/learnability.md).

Pre-tokenization is `Split("\\n", isolated)` + `Digits(individual_digits=True)` +
`ByteLevel(use_regex=False)`:

- every digit is its own token, so a small model copies numbers digit by digit;
- `\\n` is always a token of its own and the added tokens (`<|im_start|>`, `<|im_end|>`, the tool tags)
  are cut out before BPE runs, so no merge ever spans a message boundary. Encoding a rendered
  conversation piece by piece (prompt, generated ids, tool turn) therefore gives the same ids as
  encoding it whole: the rollout side can append pieces without re-tokenizing (token-in, token-out);
- byte-level: any unicode text (emoji, NUL) encodes and decodes back exactly; nothing is `<unk>`.

The tokenizer carries `pacerl.envs.chat_template.CHATML_TOOLS_TEMPLATE`, so env messages and tool schemas
render with `tokenizer.apply_chat_template(messages, tools=env.tool_schemas())`.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pacerl.envs import code_math, get_tool, load_tasks
from pacerl.envs import math as math_env
from pacerl.envs import search as search_env
from pacerl.envs.chat_template import CHATML_TOOLS_TEMPLATE
from pacerl.envs.jsonl import read_jsonl
from pacerl.envs.spaces import Message
from pacerl.envs.tasks import DATA_DIR, Task
from pacerl.envs.tools.search import format_documents

log = logging.getLogger(__name__)

PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CONTROL_TOKENS = (PAD, IM_START, IM_END)
"""Special tokens: `skip_special_tokens=True` drops them when decoding."""
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Added but not special (as in Qwen2.5/Qwen3): decoding with `skip_special_tokens=True`, the default of
SGLang and many servers, keeps them, so the env's parser still sees the model's tool calls."""
ADDED_TOKENS = CONTROL_TOKENS + TOOL_TOKENS
"""Each one a single id, in this order from id 0."""

_ADDED_RE = re.compile("|".join(re.escape(token) for token in ADDED_TOKENS))


@dataclass(frozen=True)
class TokenizerFamily:
    """The special tokens and chat template a tokenizer carries: pacerl's own by default."""

    special_tokens: tuple[str, ...] = CONTROL_TOKENS
    """Control tokens, one id each from id 0 (`skip_special_tokens=True` drops them)."""
    added_tokens: tuple[str, ...] = TOOL_TOKENS
    """Single-id tokens that decoding always keeps (tool and reasoning tags, as Qwen marks them)."""
    eos_token: str = IM_END
    """The end-of-turn token (the engine stops on it)."""
    pad_token: str = PAD
    bos_token: str | None = None
    """Written by templates that start with `{{ bos_token }}` (Llama 3.x)."""
    chat_template: str = CHATML_TOOLS_TEMPLATE

    def __post_init__(self) -> None:
        named = {self.eos_token, self.pad_token} | ({self.bos_token} if self.bos_token else set())
        if not named <= set(self.special_tokens):
            raise ValueError(f"eos, pad and bos tokens must be among the special tokens: {sorted(named)}")


def train_tokenizer(
    texts: Iterable[str],
    vocab_cap: int = 512,
    *,
    family: TokenizerFamily | None = None,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `texts` with at most `vocab_cap` ids (fewer when the corpus runs out of
    pairs seen twice). Deterministic: the same texts give the same vocabulary and merges.

    `family`: another model family's special tokens and chat template (a test stand-in for a real
    checkpoint's tokenizer, e.g. Qwen3's or Llama 3.1's, trained offline); default: pacerl's own."""
    family = family or TokenizerFamily()
    added = family.special_tokens + family.added_tokens
    minimum = 256 + len(added)
    if vocab_cap < minimum:
        raise ValueError(f"vocab_cap must be >= {minimum} (256 bytes + {len(added)} added tokens)")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("\n", behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_cap,
        min_frequency=2,
        special_tokens=list(added),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The trainer does not cut added tokens out of its input; without this it would spend merges on
    # `<|im_end|>`-spanning pairs that encoding never produces.
    added_re = re.compile("|".join(re.escape(token) for token in added))
    backend.train_from_iterator(_without_added_tokens(texts, added_re), trainer)
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in family.added_tokens])
    return _wrap(backend, family)


def _without_added_tokens(texts: Iterable[str], added_re: re.Pattern[str] = _ADDED_RE) -> Iterator[str]:
    for text in texts:
        yield from (piece for piece in added_re.split(text) if piece)


def _wrap(backend: Tokenizer, family: TokenizerFamily | None = None) -> PreTrainedTokenizerFast:
    family = family or TokenizerFamily()
    named = (family.eos_token, family.pad_token, family.bos_token)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers leaves __init__ untyped
        tokenizer_object=backend,
        eos_token=family.eos_token,
        pad_token=family.pad_token,
        bos_token=family.bos_token,
        extra_special_tokens=[token for token in family.special_tokens if token not in named],
        chat_template=family.chat_template,
        # The default cleanup rewrites " ." and " 's", which breaks the exact byte-level round trip.
        clean_up_tokenization_spaces=False,
    )


def with_chat_template(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """`tokenizer` as it is when it carries a chat template (a checkpoint's own: Qwen2.5's, Qwen3's,
    Llama's render tools and reasoning their family's way); one without any (a base model's) gets
    pacerl's `CHATML_TOOLS_TEMPLATE`, the tiny model's ChatML with Hermes tool calls, and a warning."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer
    log.warning(
        "the tokenizer has no chat template; using pacerl's ChatML-with-tools template (set "
        "chat_template in the checkpoint's tokenizer_config.json to use the model's own)"
    )
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    return tokenizer


@functools.cache
def _tiny_tokenizer_json() -> str:
    return train_tokenizer(default_corpus()).backend_tokenizer.to_str()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The default tokenizer, trained on `default_corpus()` once per process (a fresh wrapper each call,
    so one caller's changes never leak into another's)."""
    return _wrap(Tokenizer.from_str(_tiny_tokenizer_json()))


# -- the default corpus ---------------------------------------------------------------------------------


def default_corpus(seed: int = 0, per_env: int = 600) -> list[str]:
    """Rendered conversations like the ones pacerl's envs produce: CodeMath (python calls as Hermes
    `<tool_call>` JSON and fenced blocks, their outputs and errors, `\\boxed{}` answers), Math (direct
    `\\boxed{}` answers) and Search (search calls, Search-R1 passages, `<answer>` tags)."""
    rng = random.Random(seed)
    # An untrained tokenizer renders exactly as the trained one will: the template is all that matters.
    renderer = _wrap(Tokenizer(models.BPE()))
    python_schema = get_tool("python").schema()
    search_schema = get_tool("search").schema()
    texts = []
    # CodeMath's plain questions, then its other surface forms (the training forms: the held-out ones
    # recombine their wordings and notations), so that no wording is spelt out byte by byte.
    codemath = load_tasks("codemath-train")[:per_env] + load_tasks("codemath-forms-train")[: per_env // 2]
    for task in codemath:
        texts.append(_render(renderer, _code_math_episode(task, rng), [python_schema]))
    for task in load_tasks("math-train")[:per_env]:
        texts.append(_render(renderer, _math_episode(task.question, task.answer), None))
    documents = _search_documents()
    for task in load_tasks("search-train")[:per_env]:
        episode = _search_episode(task, documents, rng)
        texts.append(_render(renderer, episode, [search_schema]))
    return texts


def _render(
    renderer: PreTrainedTokenizerFast, messages: list[Message], tools: list[dict[str, Any]] | None
) -> str:
    text = renderer.apply_chat_template(messages, tools=list(tools) if tools else None, tokenize=False)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) gave a {type(text).__name__}")
    return text


def _python_call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


def _code_math_episode(task: Task, rng: random.Random) -> list[Message]:
    """A CodeMath episode on `task` in any of its surface forms: its program (`code_math.task_program`)
    as a Hermes call or a fenced block, sometimes after a failed first attempt."""
    code = code_math.task_program(task)
    messages: list[Message] = [
        {"role": "system", "content": code_math.SYSTEM_PROMPT},
        {"role": "user", "content": task.question},
    ]
    style = rng.random()
    if style < 0.15:
        # A failed first attempt, as the sandbox reports it, then a fixed call.
        messages += [
            {"role": "assistant", "content": _python_call(code.removesuffix(")"))},
            {"role": "tool", "content": "SyntaxError: '(' was never closed"},
        ]
    if style < 0.8:
        messages.append({"role": "assistant", "content": _python_call(code)})
    else:
        messages.append({"role": "assistant", "content": f"```python\n{code}\n```"})
    messages += [
        {"role": "tool", "content": task.answer},
        {"role": "assistant", "content": f"\\boxed{{{task.answer}}}"},
    ]
    return messages


def _math_episode(question: str, answer: str) -> list[Message]:
    return [
        {"role": "system", "content": math_env.SYSTEM_PROMPT},
        {"role": "user", "content": question},
        {"role": "assistant", "content": f"The answer is \\boxed{{{answer}}}."},
    ]


def _search_documents() -> dict[str, str]:
    """The shipped corpus's passages by title."""
    rows = (str(row["contents"]) for _, row in read_jsonl(DATA_DIR / "search-corpus.jsonl"))
    return {contents.partition("\n")[0].strip('"'): contents for contents in rows}


def _search_episode(task: Task, documents: dict[str, str], rng: random.Random) -> list[Message]:
    """One search per hop for the entity the task's metadata names (`pacerl.envs.search_world`), as the
    env's demonstrations call it, its passage first and two others after it (more text to learn merges
    from), then the answer."""
    messages: list[Message] = [
        {"role": "system", "content": search_env.SYSTEM_PROMPT},
        {"role": "user", "content": task.question},
    ]
    others = list(documents.values())
    for query in task.metadata.get("queries") or [task.question]:
        hits = [documents[query]] if query in documents else []
        call = {"name": "search", "arguments": {"query": query, "topk": search_env.DEMONSTRATION_TOPK}}
        messages += [
            {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
            {
                "role": "tool",
                "content": format_documents([{"contents": doc} for doc in hits + rng.sample(others, 2)]),
            },
        ]
    return [*messages, {"role": "assistant", "content": f"<answer> {task.answer} </answer>"}]
