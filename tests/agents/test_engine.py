"""The embedded engine: continuous batching that matches plain generation, exact log-probs, version
tags across a weight update, routed experts, aborts and bad input."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from pacerl.agents.engine.embedded import (
    ContextOverflowError,
    EmbeddedEngine,
    EmbeddedEngineConfig,
    _GateRecorder,
)
from pacerl.agents.engine.protocol import FinishReason, SamplingParams
from pacerl.agents.engine.slot_cache import SlotCache, packable
from tests.agents.helpers import reference_greedy, tiny_moe

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


async def generated_at_least(engine: EmbeddedEngine, count: int) -> None:
    """Wait (step by step) until the engine's first running request has `count` tokens."""
    for _ in range(100_000):
        if engine._rows and len(engine._rows[0].tokens) >= count:
            return
        await asyncio.sleep(0)
    raise TimeoutError("the engine made no progress")


def full_logprobs(model: Qwen3MoeForCausalLM, prompt: list[int], tokens: tuple[int, ...]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + list(tokens)])).logits[0].float()
    table = torch.log_softmax(logits, -1)
    return [float(table[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "prefill-then-decode"])
async def test_continuous_batching_matches_one_by_one_greedy(packed: bool) -> None:
    model = tiny_moe()
    engine = EmbeddedEngine(model, config=EmbeddedEngineConfig(max_batch=4))
    engine._packed = packed  # the path of models whose attention the engine cannot pack, on this one
    prompts = [[5 + i % 7] * (2 + 3 * i) for i in range(10)]  # different lengths join and leave
    lengths = [3 + 2 * (i % 4) for i in range(10)]
    results = await asyncio.gather(
        *(
            engine.generate(p, SamplingParams(max_new_tokens=n, temperature=0))
            for p, n in zip(prompts, lengths, strict=True)
        )
    )
    await engine.aclose()
    for prompt, length, result in zip(prompts, lengths, results, strict=True):
        assert list(result.tokens) == reference_greedy(model, prompt, length)
        assert result.finish_reason is FinishReason.LENGTH and result.versions == (0,) * length
        assert result.logprobs == pytest.approx(full_logprobs(model, prompt, result.tokens), abs=1e-5)


async def test_sampled_logprobs_are_those_of_the_sampling_distribution() -> None:
    model = tiny_moe()
    engine = EmbeddedEngine(model)
    prompt = [7, 8, 9]
    result = await engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0.7, seed=3))
    await engine.aclose()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + list(result.tokens)])).logits[0].float() / 0.7
    table = torch.log_softmax(logits, -1)
    expected = [float(table[len(prompt) - 1 + i, t]) for i, t in enumerate(result.tokens)]
    assert result.logprobs == pytest.approx(expected, abs=1e-5)
    again = EmbeddedEngine(model)
    assert (
        await again.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0.7, seed=3))
    ).tokens == result.tokens
    await again.aclose()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "prefill-then-decode"])
@pytest.mark.parametrize("interrupt", ["reprefill", "continue"])
async def test_weight_update_mid_generation_tags_versions(interrupt: str, packed: bool) -> None:
    model = tiny_moe()
    engine = EmbeddedEngine(model, config=EmbeddedEngineConfig(interrupt=interrupt))  # type: ignore[arg-type]
    engine._packed = packed  # the path of models whose attention the engine cannot pack, on this one
    new_weights = {k: v + 0.05 * torch.randn_like(v) for k, v in tiny_moe(seed=1).state_dict().items()}
    prompt = [3, 4, 5, 6]
    task = asyncio.ensure_future(engine.generate(prompt, SamplingParams(max_new_tokens=20, temperature=0)))
    await generated_at_least(engine, 6)
    await engine.update_weights(new_weights, version=1)
    result = await task
    await engine.aclose()
    switch = result.versions.index(1)
    assert 6 <= switch < 20
    assert result.versions == (0,) * switch + (1,) * (20 - switch)  # the tag changes exactly once
    old = tiny_moe()
    assert list(result.tokens[:switch]) == reference_greedy(old, prompt, switch)
    if interrupt == "reprefill":
        # Resumed under the new weights, the rest equals a fresh greedy generation under them.
        fresh = tiny_moe()
        fresh.load_state_dict(new_weights)
        prefix = prompt + list(result.tokens[:switch])
        assert list(result.tokens[switch:]) == reference_greedy(fresh, prefix, 20 - switch)
        expected = full_logprobs(fresh, prefix, result.tokens[switch:])
        assert result.logprobs[switch:] == pytest.approx(expected, abs=1e-5)


async def test_routed_experts_cover_every_fed_position() -> None:
    model = tiny_moe()
    engine = EmbeddedEngine(model)
    assert engine.is_moe
    prompt = [10, 11, 12, 13, 14]
    result = await engine.generate(prompt, GREEDY, return_routed_experts=True)
    plain = await engine.generate(prompt, GREEDY)
    await engine.aclose()
    routes = result.routed_experts
    assert routes is not None and plain.routed_experts is None
    assert routes.shape == (len(prompt) + len(result.tokens) - 1, 2, 2)  # SGLang's layout
    assert routes.min() >= 0 and routes.max() < 8
    assert all(len(set(row)) == 2 for layer_rows in routes for row in layer_rows)  # top-2 distinct experts
    # The routes are those a plain forward over the same positions chooses (one request: no padding).
    recorder = _GateRecorder(model)
    with torch.no_grad():
        model(torch.tensor([prompt + list(result.tokens[:-1])]))
    full = recorder.take()
    recorder.close()
    assert full is not None
    assert (routes == full).all()


async def test_routes_from_a_start_position_are_the_tail_of_the_whole_stream() -> None:
    """`routed_experts_start_len` (SGLang's field): the rows of input positions from the start on, the
    same as the whole stream's from there; `len(prompt)` leaves out the prompt's last position too."""
    engine = EmbeddedEngine(tiny_moe())
    prompt = [10, 11, 12, 13, 14]
    whole = await engine.generate(prompt, GREEDY, return_routed_experts=True)
    assert whole.routed_experts is not None and whole.routed_experts_start == 0
    for start in (1, 3, len(prompt)):
        part = await engine.generate(
            prompt, GREEDY, return_routed_experts=True, routed_experts_start_len=start
        )
        assert part.tokens == whole.tokens and part.routed_experts_start == start
        assert part.routed_experts is not None
        assert part.routed_experts.shape == (len(prompt) + len(part.tokens) - 1 - start, 2, 2)
        assert (part.routed_experts == whole.routed_experts[start:]).all()
    for bad in (-1, len(prompt) + 1, True):
        with pytest.raises(ValueError, match=r"routed_experts_start_len must be an int in \[0, 5\]"):
            await engine.generate(prompt, GREEDY, return_routed_experts=True, routed_experts_start_len=bad)
    await engine.aclose()


async def test_abort_stop_tokens_and_bad_input() -> None:
    model = tiny_moe()
    engine = EmbeddedEngine(model, config=EmbeddedEngineConfig(max_context=64))
    task = asyncio.ensure_future(
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=50, temperature=0), request_id="a")
    )
    await generated_at_least(engine, 3)
    await engine.abort("a")
    aborted = await task
    assert aborted.finish_reason is FinishReason.ABORT and 3 <= len(aborted.tokens) < 50
    first = (await engine.generate([9, 9], GREEDY)).tokens[2]
    stopped = await engine.generate(
        [9, 9], SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=(first,))
    )
    assert (
        stopped.finish_reason is FinishReason.STOP
        and stopped.tokens[-1] == first
        and len(stopped.tokens) <= 3
    )
    long = await engine.generate([2] * 60, SamplingParams(max_new_tokens=50, temperature=0))
    assert long.finish_reason is FinishReason.LENGTH and len(long.tokens) == 4  # the context is full
    with pytest.raises(ContextOverflowError, match="the context holds 64"):
        await engine.generate([2] * 64, GREEDY)
    with pytest.raises(ValueError, match="input_ids is empty"):
        await engine.generate([], GREEDY)
    with pytest.raises(ValueError, match=r"must exceed the current 0"):
        await engine.update_weights({}, version=0)
    with pytest.raises(ValueError, match="unknown parameter names"):
        await engine.update_weights({"nope": torch.zeros(1)}, version=1)
    assert await engine.health()
    await engine.aclose()
    assert not await engine.health()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be a positive int"),
        ({"temperature": -1.0}, "temperature must be finite"),
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be an int"),
        ({"stop_strings": ("",)}, "stop_strings must be non-empty"),
    ],
)
def test_invalid_sampling_parameters_fail_before_work(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
async def test_routes_are_captured_for_both_moe_families(family: str) -> None:
    from pacerl.agents.models import TinyMoEConfig, build_tiny_moe, moe_info
    from pacerl.agents.tokenizer import tiny_tokenizer

    model = build_tiny_moe(TinyMoEConfig(family=family), tiny_tokenizer())  # type: ignore[arg-type]
    engine = EmbeddedEngine(model)
    info = moe_info(model)
    assert engine._recorder.gates == list(info.gates)
    result = await engine.generate([5, 6, 7, 8], GREEDY, return_routed_experts=True)
    await engine.aclose()
    assert result.routed_experts is not None
    assert result.routed_experts.shape == (4 + len(result.tokens) - 1, info.num_layers, info.top_k)
    assert engine._recorder._handles == []  # hooks removed on close: the model is left as it was


async def test_recorded_routes_replay_to_identical_logprobs() -> None:
    """R3's premise: forcing a training forward onto the engine's recorded experts (gate weights
    recomputed from the live router logits over them) reproduces the engine's log-probs exactly."""
    model = tiny_moe()
    engine = EmbeddedEngine(model)
    prompt = [21, 22, 23, 24, 25, 26]
    result = await engine.generate(
        prompt, SamplingParams(max_new_tokens=10, temperature=0.8, seed=5), return_routed_experts=True
    )
    await engine.aclose()
    assert result.routed_experts is not None
    recorded = torch.from_numpy(result.routed_experts).long()  # [positions, layers, top_k]

    def replayed_logprobs(routes: torch.Tensor) -> list[float]:
        def replay(layer: int) -> object:
            def hook(module: torch.nn.Module, inputs: object, output: tuple[torch.Tensor, ...]) -> object:
                logits = output[0]
                chosen = routes[:, layer]
                weights = torch.softmax(logits.float(), -1).gather(-1, chosen)
                if module.norm_topk_prob:  # as the router itself does
                    weights = weights / weights.sum(-1, keepdim=True)
                return logits, weights.to(logits.dtype), chosen

            return hook

        layers = model.model.layers
        handles = [layer.mlp.gate.register_forward_hook(replay(i)) for i, layer in enumerate(layers)]
        try:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(result.tokens[:-1])])).logits[0].float() / 0.8
        finally:
            for handle in handles:
                handle.remove()
        table = torch.log_softmax(logits, -1)
        return [float(table[len(prompt) - 1 + i, t]) for i, t in enumerate(result.tokens)]

    assert replayed_logprobs(recorded) == pytest.approx(list(result.logprobs), abs=1e-5)
    # The replay really decides the routing: other experts give other log-probs.
    assert replayed_logprobs((recorded + 3) % 8) != pytest.approx(list(result.logprobs), abs=1e-3)


def test_one_engine_serves_successive_event_loops() -> None:
    engine = EmbeddedEngine(tiny_moe())
    first = asyncio.run(engine.generate([3, 4], GREEDY))
    second = asyncio.run(engine.generate([3, 4], GREEDY))  # a new loop: fresh loop-bound state
    assert first.tokens == second.tokens
    asyncio.run(engine.aclose())


async def test_router_noise_moves_only_the_engines_routers_and_is_drawn_anew_per_load() -> None:
    """`router_noise` (the stand-in for an engine whose kernels route some tokens differently from the
    trainer's): the engine's router tensors, and only they, differ from the weights it was given by
    noise of the configured relative size, redrawn at each load; the routes it records are its own."""
    trainer = tiny_moe()
    clean = {k: v.clone() for k, v in trainer.state_dict().items()}
    engine_model = tiny_moe()
    engine = EmbeddedEngine(engine_model, config=EmbeddedEngineConfig(router_noise=0.5, seed=3))
    gates = sorted(engine._router_params)
    assert gates == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]

    def relative_noise(name: str, against: dict[str, torch.Tensor]) -> float:
        given = against[name]
        moved = engine_model.state_dict()[name] - given
        return float(moved.pow(2).mean().sqrt() / given.pow(2).mean().sqrt())

    for name, tensor in engine_model.state_dict().items():
        if name in gates:
            assert 0.4 < relative_noise(name, clean) < 0.6
        else:
            assert torch.equal(tensor, clean[name])
    first = engine_model.state_dict()[gates[0]].clone()
    await engine.update_weights(clean, version=1)  # the same weights again: fresh noise on them
    second = engine_model.state_dict()[gates[0]]
    assert 0.4 < relative_noise(gates[0], clean) < 0.6 and not torch.equal(first, second)
    # A partial update without the routers leaves their noise as it was (never added twice).
    others = {k: v for k, v in clean.items() if k not in gates}
    await engine.update_weights(others, version=2)
    assert torch.equal(engine_model.state_dict()[gates[0]], second)
    prompt = [10, 11, 12, 13, 14, 15, 16, 17]
    result = await engine.generate(prompt, GREEDY, return_routed_experts=True)
    await engine.aclose()
    recorder = _GateRecorder(trainer)
    with torch.no_grad():
        trainer(torch.tensor([prompt + list(result.tokens[:-1])]))
    trainer_routes = recorder.take()
    recorder.close()
    assert result.routed_experts is not None and trainer_routes is not None
    assert (result.routed_experts != trainer_routes).any()  # the trainer would route some tokens elsewhere
    with pytest.raises(ValueError, match="router_noise must be >= 0"):
        EmbeddedEngineConfig(router_noise=-0.1)


def test_slot_cache_keeps_every_rows_keys_through_joins_leaves_shifts_and_growth() -> None:
    """The preallocated cache: rows join (one with a prompt longer than the used columns, which moves
    them right), decode for long enough that the columns run out (they move to the front and the
    buffers grow), and leave from the middle (the last row moves into the slot). Throughout, each row
    attends to exactly its own keys, in order."""
    cache = SlotCache(num_layers=1, max_rows=4, device=torch.device("cpu"))
    fed: dict[int, list[float]] = {}  # request -> the keys it was fed, in order (key = a unique number)
    slots: list[int] = []  # the request in each slot
    counter = iter(range(1, 1_000_000))

    def forward(tokens: torch.Tensor) -> None:
        """One forward through the cache's single layer; `tokens` `[rows, width]` are the new keys."""
        keys = tokens[:, None, :, None].expand(-1, 2, -1, 3)  # [rows, kv_heads, width, head_dim]
        cache.slot_layers[0].update(keys, keys.clone(), 0)

    def join(lengths: list[int]) -> None:
        width = max(lengths)
        mask = torch.arange(width)[None, :] >= torch.tensor([width - n for n in lengths])[:, None]
        cache.join(mask, lengths)
        tokens = torch.zeros(len(lengths), width)
        for row, n in enumerate(lengths):
            request = next(counter)
            fed[request] = [float(next(counter)) for _ in range(n)]
            tokens[row, width - n :] = torch.tensor(fed[request])
            slots.append(request)
        forward(tokens)

    def decode() -> None:
        cache.decode()
        new = [float(next(counter)) for _ in slots]
        for request, key in zip(slots, new, strict=True):
            fed[request].append(key)
        forward(torch.tensor(new)[:, None])
        cache.advance()

    def leave(rows: list[int]) -> None:
        movers, holes = cache.remove(rows)
        for hole, mover in zip(holes, movers, strict=True):
            slots[hole] = slots[mover]
        del slots[len(slots) - len(rows) :]

    def check() -> None:
        keys = cache.slot_layers[0].keys
        assert keys is not None and cache.rows == len(slots)
        start, end = cache.start, cache.end
        for row, request in enumerate(slots):
            visible = cache.mask[row, start:end]
            assert keys[row, 0, start:end, 0][visible].tolist() == fed[request]
            assert cache.starts[row] == end - len(fed[request])
            assert visible.tolist() == [False] * (cache.starts[row] - start) + [True] * len(fed[request])

    join([3, 5])
    check()
    assert cache.mask.shape[0] == 2
    for _ in range(3):
        decode()
    join([20])  # longer than the 8 used columns: they move right (and the slots grow)
    check()
    assert cache.mask.shape[0] == 4
    decode()
    leave([0])  # the last row moves into slot 0
    check()
    shape = cache.mask.shape
    for _ in range(100):  # the columns run out: moved to the front, the buffers grown
        decode()
    assert cache.mask.shape[1] > shape[1]
    check()
    join([2, 4])  # every slot in use
    check()
    decode()
    leave([1, 2])  # from the middle
    check()
    leave([0, 1])
    assert cache.rows == 0
    join([6])  # an empty cache starts again from its first column
    check()
    assert cache.start == 0 and cache.end == 6


async def test_rows_joining_a_long_running_batch_match_one_by_one_greedy() -> None:
    """Through the cache's rarer moves: a prompt longer than the columns in use joins a running batch
    (the columns move right), and a long generation runs past the buffers' first columns (they move to
    the front and grow). Every request's tokens and log-probs are those it gets alone."""
    model = tiny_moe()
    engine = EmbeddedEngine(model, config=EmbeddedEngineConfig(max_batch=2))
    jobs = [([5, 6, 7], 120), ([9, 9], 10), ([11 + i % 5 for i in range(50)], 20)]
    results = await asyncio.gather(
        *(engine.generate(p, SamplingParams(max_new_tokens=n, temperature=0)) for p, n in jobs)
    )
    await engine.aclose()
    assert engine._cache.mask.shape[1] > 2 * (50 + 1)  # grown past the first allocation
    for (prompt, length), result in zip(jobs, results, strict=True):
        assert list(result.tokens) == reference_greedy(model, prompt, length)
        assert result.logprobs == pytest.approx(full_logprobs(model, prompt, result.tokens), abs=1e-5)


async def test_routes_of_requests_that_join_a_running_batch_are_their_own() -> None:
    """A packed forward holds the running rows' tokens and the joining prompts: each request's routes
    (prompt positions from the forward it joined in, then one per decoded input) are those a plain
    forward over its own sequence chooses."""
    model = tiny_moe()
    engine = EmbeddedEngine(model, config=EmbeddedEngineConfig(max_batch=3))
    prompts = [[20 + i] * (3 + 4 * i) for i in range(6)]
    lengths = [9, 3, 6, 4, 8, 5]
    results = await asyncio.gather(
        *(
            engine.generate(p, SamplingParams(max_new_tokens=n, temperature=0), return_routed_experts=True)
            for p, n in zip(prompts, lengths, strict=True)
        )
    )
    await engine.aclose()
    recorder = _GateRecorder(model)
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            model(torch.tensor([prompt + list(result.tokens[:-1])]))
        plain = recorder.take()
        assert plain is not None and result.routed_experts is not None
        assert (result.routed_experts == plain).all()
    recorder.close()


async def test_the_engine_runs_its_attention_only_while_it_steps() -> None:
    """The engine switches the model to its attention function while its worker steps: afterwards the
    model computes as before, through its own attention."""
    model = tiny_moe()
    assert packable(model)
    before = model.config._attn_implementation
    prompt = [4, 5, 6, 7]
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits
    engine = EmbeddedEngine(model)
    await engine.generate(prompt, GREEDY)
    await engine.aclose()
    assert model.config._attn_implementation == before
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([prompt])).logits, expected)


async def test_a_model_the_engine_cannot_pack_runs_prefill_and_decode_forwards() -> None:
    """A sliding-window model: the engine's packed attention would attend to the whole context, so it
    runs the model's own attention (a prefill forward, then a decode forward per step) and matches
    plain generation, whose window is shorter than the sequences."""
    model = tiny_moe(use_sliding_window=True, sliding_window=6, max_window_layers=0)
    assert not packable(model)
    engine = EmbeddedEngine(model, config=EmbeddedEngineConfig(max_batch=4))
    prompts = [[5 + i % 7] * (2 + 3 * i) for i in range(8)]
    lengths = [3 + 2 * (i % 4) for i in range(8)]
    results = await asyncio.gather(
        *(
            engine.generate(p, SamplingParams(max_new_tokens=n, temperature=0), return_routed_experts=True)
            for p, n in zip(prompts, lengths, strict=True)
        )
    )
    await engine.aclose()
    for prompt, length, result in zip(prompts, lengths, results, strict=True):
        assert list(result.tokens) == reference_greedy(model, prompt, length)
        assert result.logprobs == pytest.approx(full_logprobs(model, prompt, result.tokens), abs=1e-5)
        assert result.routed_experts is not None
        assert result.routed_experts.shape == (len(prompt) + length - 1, 2, 2)


async def test_engines_sharing_a_model_each_generate_what_they_would_alone() -> None:
    """Two engines over one model, their forwards overlapping on their worker threads: each sees the
    engines' attention for all its forward (the last one out restores the model's)."""
    model = tiny_moe()
    prompts = [[3 + i] * (4 + 5 * i) for i in range(8)]
    sampling = SamplingParams(max_new_tokens=40, temperature=0)
    first, second = EmbeddedEngine(model), EmbeddedEngine(model)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the worker threads take turns within each other's forwards
    try:
        together = await asyncio.gather(
            *(engine.generate(p, sampling) for p in prompts for engine in (first, second))
        )
    finally:
        sys.setswitchinterval(interval)
    await first.aclose()
    await second.aclose()
    assert model.config._attn_implementation == "sdpa"
    for prompt, a, b in zip(prompts, together[::2], together[1::2], strict=True):
        assert list(a.tokens) == list(b.tokens) == reference_greedy(model, prompt, 40)
