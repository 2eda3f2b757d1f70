"""Helpers shared by the trainer tests (imported from here, never from another test module)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from pacerl.agents.models import TinyMoEConfig, build_tiny_moe
from pacerl.agents.routing import RoutedExperts
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.agents.trajectory import Status, Trajectory
from pacerl.trainer.learner import Learner


def small_model() -> torch.nn.Module:
    return build_tiny_moe(TinyMoEConfig(num_layers=2), tiny_tokenizer())


def make_trajectory(
    name: str,
    group: str,
    reward: float,
    response: list[int],
    *,
    routes: np.ndarray | None = None,
    logprob: float = -2.0,
) -> Trajectory:
    trajectory = Trajectory.start(name, group, "task", [5, 6, 7])
    experts = None if routes is None else RoutedExperts.from_array(routes, num_experts=8)
    trajectory.append_model(
        response,
        [logprob] * len(response),
        version=0,
        started_at=0.0,
        ended_at=0.0,
        finish_reason="stop",
        routed_experts=experts,
    )
    trajectory.finish(Status.COMPLETED, reason="", reward=reward, completed_version=0, completed_at=0.0)
    return trajectory


def on_policy(learner: Learner, groups: list[list[Trajectory]]) -> list[list[Trajectory]]:
    """The same trajectories with behaviour log-probs equal to the model's own (a fresh rollout)."""
    flat = [t for group in groups for t in group]
    batch, logprobs, _ = learner.logprobs(flat)
    rebuilt = []
    for row, trajectory in enumerate(flat):
        response = list(trajectory.segments[1].tokens)
        values = logprobs[row][batch.loss_mask[row]].tolist()
        copy_ = Trajectory.start(trajectory.id, trajectory.group_id, "task", trajectory.segments[0].tokens)
        copy_.append_model(response, values, version=0, started_at=0.0, ended_at=0.0, finish_reason="stop")
        copy_.finish(
            Status.COMPLETED, reason="", reward=trajectory.reward, completed_version=0, completed_at=0.0
        )
        rebuilt.append(copy_)
    return [rebuilt[i : i + len(groups[0])] for i in range(0, len(rebuilt), len(groups[0]))]


def two_groups() -> list[list[Trajectory]]:
    return [
        [make_trajectory("a/0", "a", 1.0, [20, 21, 22]), make_trajectory("a/1", "a", 0.0, [30, 31])],
        [make_trajectory("b/0", "b", 0.0, [40, 41, 42, 43]), make_trajectory("b/1", "b", 1.0, [50])],
    ]


RAGGED = [(40, 3, 25, 4), (17, 17, 9, 31), (2, 40, 3, 25), (4, 17, 9, 31), (31, 2, 2, 40), (9, 3, 17, 25)]
"""Six groups of four responses whose lengths differ by up to 20× within and across groups."""


@functools.cache
def ragged_groups_of_small_model(seed: int = 0, far: float = 0.0) -> list[list[Trajectory]]:
    """`ragged_groups` of `small_model()` (the same weights every call), built once per module."""
    return ragged_groups(small_model(), seed=seed, far=far)


def ragged_groups(model: torch.nn.Module, *, seed: int = 0, far: float = 0.0) -> list[list[Trajectory]]:
    """Groups of RAGGED lengths with mixed rewards and behaviour log-probs near the model's own
    (noise 0.3, plus `far` on every seventh token: stale outliers for SAT to gate)."""
    generator = torch.Generator().manual_seed(seed)
    scorer = Learner(model)
    groups: list[list[Trajectory]] = []
    for g, lengths in enumerate(RAGGED):
        group = []
        for m, length in enumerate(lengths):
            prompt = [5 + (g + m) % 7, 6, 7]
            response = torch.randint(20, 120, (length,), generator=generator).tolist()
            draft = Trajectory.start(f"{g}/{m}", f"g{g}", "task", prompt)
            draft.append_model(
                response, [-1.0] * length, version=0, started_at=0.0, ended_at=0.0, finish_reason="stop"
            )
            batch, own, _ = scorer.logprobs([draft])
            noise = 0.3 * torch.randn(length, generator=generator)
            noise[::7] += far
            behaviour = (own[0][batch.loss_mask[0]] + noise).clamp_max(-1e-3).tolist()
            trajectory = Trajectory.start(f"{g}/{m}", f"g{g}", "task", prompt)
            trajectory.append_model(
                response, behaviour, version=0, started_at=0.0, ended_at=0.0, finish_reason="stop"
            )
            reward = float((g + m) % 3 == 0) if m < 3 else float(g % 2)
            trajectory.finish(
                Status.COMPLETED, reason="", reward=reward, completed_version=0, completed_at=0.0
            )
            group.append(trajectory)
        groups.append(group)
    return groups
