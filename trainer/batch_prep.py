"""From a batch of trajectory groups to what the learner's updates train on.

`prepare_batch` keeps the trajectories that carry signal and gives each its advantage from the chosen
estimator (`pacerl.trainer.advantages`) and the index of its group; `update_plan` splits the kept groups,
shuffled, into the step's mini-batches of whole groups, one optimizer update each, for every epoch
(AReaL's `ppo_n_minibatches`, verl's `ppo_mini_batch_size` and `ppo_epochs`); `micro_batches` splits one
update's members into forward/backward chunks of whole groups. Trajectories are named by their
position in `PreparedBatch.trajectories` throughout.

Leave-outs are counted in the `counts` handed in, under their reason: `failed_member` (a trajectory
without a reward is left out of its group's advantages), `zero_advantage` (a group whose rewards are
all equal carries no signal), `empty_response` (no model token: nothing to train on, but its reward
still counts in its group).
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from pacerl.agents.trajectory import Trajectory
from pacerl.trainer.advantages import dr_grpo_advantages, grpo_advantages, reinforce_pp_baseline_advantages

AdvantageName = Literal["grpo", "dr_grpo", "reinforce_pp"]
ADVANTAGES: tuple[AdvantageName, ...] = ("grpo", "dr_grpo", "reinforce_pp")
"""The advantage estimators `learner.advantage` chooses from."""
AdvantageStd = Literal["population", "unbiased"]
PlannedUpdate = tuple[int, list[int]]
"""(epoch, positions of the trajectories) of one optimizer update; a group's members are consecutive."""


@dataclass
class PreparedBatch:
    """The trajectories a step trains on, in parallel lists (position i is one trajectory)."""

    trajectories: list[Trajectory]
    """Trajectories with a reward, at least one model token, in a group that carries signal."""
    advantages: list[float]
    """One per trajectory (every token of it shares it)."""
    group_index: list[int]
    """The index of its group among the kept groups (0, 1, ...; members of a group are consecutive)."""


def prepare_batch(
    groups: Sequence[Sequence[Trajectory]],
    *,
    advantage: AdvantageName,
    advantage_std: AdvantageStd,
    drop_zero_advantage: bool,
    counts: Counter[str],
) -> PreparedBatch:
    """The trajectories of `groups` (each the trajectories of one prompt) that carry signal, with their
    advantages; leave-outs are added to `counts` (see the module docstring)."""
    prepared = PreparedBatch([], [], [])
    kept_groups = 0
    for group in groups:
        members = [t for t in group if t.reward is not None]
        counts["failed_member"] += len(group) - len(members)
        if not members:
            continue
        values = torch.tensor([[float(t.reward or 0.0) for t in members]], dtype=torch.float64)
        if drop_zero_advantage and bool((values == values[0, 0]).all()):
            counts["zero_advantage"] += 1
            continue
        advantages = _group_advantages(values, advantage, advantage_std)
        index, kept_groups = kept_groups, kept_groups + 1
        for trajectory, value in zip(members, advantages.tolist(), strict=True):
            if trajectory.num_model_tokens == 0:
                counts["empty_response"] += 1
                continue
            prepared.trajectories.append(trajectory)
            prepared.advantages.append(value)
            prepared.group_index.append(index)
    if advantage == "reinforce_pp" and prepared.advantages:
        # REINFORCE++'s normalisation is over the whole batch, not one group.
        centred = torch.tensor([prepared.advantages], dtype=torch.float64)
        prepared.advantages = reinforce_pp_baseline_advantages(centred)[0].tolist()
    return prepared


def _group_advantages(rewards: torch.Tensor, advantage: AdvantageName, std: AdvantageStd) -> torch.Tensor:
    """Advantages `[G]` of one group's rewards `[1, G]`."""
    if advantage == "grpo":
        return grpo_advantages(rewards, unbiased=std == "unbiased")[0]
    return dr_grpo_advantages(rewards)[0]  # reinforce_pp: centred here, normalised per batch later


def update_plan(
    group_index: Sequence[int], *, minibatches: int, epochs: int, shuffle_seed: int, version: int
) -> list[PlannedUpdate]:
    """The step's updates: per epoch the groups shuffled and split into `minibatches` runs of whole
    groups (fewer when there are fewer groups; members of a group stay consecutive). The shuffle is
    seeded by `shuffle_seed` and the policy `version`, so a resumed run shuffles as the original."""
    members: dict[int, list[int]] = {}
    for position, group in enumerate(group_index):
        members.setdefault(group, []).append(position)
    order = list(members)
    count = min(minibatches, len(order))
    shuffle = random.Random(shuffle_seed * 1_000_003 + version)
    plan: list[PlannedUpdate] = []
    for epoch in range(epochs):
        if count > 1 or epochs > 1:
            shuffle.shuffle(order)
        for part in range(count):
            groups = order[part * len(order) // count : (part + 1) * len(order) // count]
            plan.append((epoch, [i for group in groups for i in members[group]]))
    return plan


def micro_batches(group_index: Sequence[int], members: Sequence[int], size: int) -> list[list[int]]:
    """`members` (positions, a group's consecutive) in chunks of whole groups of about `size` sequences
    each: a chunk is closed before a group that would take it past `size`, and one larger group is a
    chunk of its own."""
    chunks: list[list[int]] = [[]]
    for _, run in itertools.groupby(members, key=group_index.__getitem__):
        group = list(run)
        if chunks[-1] and len(chunks[-1]) + len(group) > size:
            chunks.append([])
        chunks[-1].extend(group)
    return chunks
