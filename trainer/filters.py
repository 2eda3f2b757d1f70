"""Staleness filters, each declared once as a `StalenessFilter` with the traits the pool, the loop and the
run config read from it, and their registry (`FILTERS`): the built-ins (`none`, `max_age`, `admission`,
`pace`: their rules are the pool's own methods, `pacerl.trainer.pool`) and a user's, named
`filter.name=module:NAME` as a user's env is named `module:Name-v0`:

    # my_filters.py
    from pacerl.trainer.filters import StalenessFilter

    def newest_first(pool, batch_groups, v_now, drift):
        order = list(range(len(pool.pooled_groups())))[::-1]
        return [], order[:batch_groups]          # (rejected positions, drawn positions)

    NEWEST_FIRST = StalenessFilter(newest_first, reason="newest_first")

    pacerl train filter.name=my_filters:NEWEST_FIRST
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from pacerl.trainer.plugins import Registry
from pacerl.trainer.pool import (
    AdmissionSettings,
    DriftScorer,
    MaxAgeSettings,
    PaceSettings,
    TrajectoryPool,
    admission_capacity,
)

BUILT_IN_FILTERS: tuple[str, ...] = ("none", "max_age", "admission", "pace")
"""The filters pacerl ships (`FILTERS` maps every registered name to its `StalenessFilter`)."""

SelectionRule = Callable[
    [TrajectoryPool, int, int, DriftScorer | None], tuple[Sequence[int] | npt.NDArray[np.intp], ...]
]
"""A filter's selection: (pool, batch size, v_now, drift scorer) → (positions of the groups rejected,
positions of the groups drawn, in the order they are trained), positions into `pool.pooled_groups()`
(arrival order); at most the batch size drawn, none both rejected and drawn."""

AdmissionGate = Callable[[TrajectoryPool, int, int, int, int], int]
"""(pool, trainer steps, running groups, batch groups, weight lag) → how many groups may start now."""


@dataclass(frozen=True)
class StalenessFilter:
    """A staleness filter and the traits the pool, the loop and the run config read from it, declared
    once. A user's filter is one of these in the user's module, named `filter.name=module:NAME`."""

    select: SelectionRule
    """What the pool rejects and draws at each step."""
    reason: str = "filter"
    """What its rejections are counted under (`TrajectoryPool.rejections`, `rejected/<reason>` metrics)."""
    settings: type | None = None
    """The class of its own knobs: a built-in filter's section of `FilterConfig`, or built from
    `filter.options` for a user's; None: it takes no options."""
    section: str = ""
    """A built-in filter's section of `FilterConfig` ("" for a user's)."""
    admission: AdmissionGate | None = None
    """A gate on how many groups the rollout side may start (None: only `max_concurrent_groups`)."""
    check: Callable[[Any, int, int], str | None] | None = None
    """(settings, loop.batch_groups, the most versions the engine's weights trail the trainer's between
    publications) → why a run config cannot work with it, or None."""
    stall: Callable[[Any, int], str | None] | None = None
    """(settings, how many versions the engine's weights trail the trainer's now) → why it rejects every
    group at that lag, or None: the loop ends a run that waits on it (until a publication that can only
    follow a step)."""
    closed: Callable[[Any, TrajectoryPool, int, int, int], str] | None = None
    """(settings, pool, trainer steps, weight lag, batch groups) → why its `admission` gate admits no
    group, for the loop's message when a batch can never form."""


def _positions(rule: Callable[..., tuple[Any, Any]]) -> SelectionRule:
    def select(
        pool: TrajectoryPool, batch_groups: int, v_now: int, drift: DriftScorer | None
    ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
        return rule(pool, *pool._live_index(), batch_groups, v_now, drift)

    return select


def _admission_gate(pool: TrajectoryPool, steps: int, running: int, batch: int, lag: int) -> int:
    return admission_capacity(
        trainer_steps=steps,
        running_groups=running,
        accepted_groups=pool.accepted_groups,
        batch_groups=batch,
        max_concurrent_groups=pool.config.max_concurrent_groups,
        max_offpolicyness=pool.config.admission.max_offpolicyness,
        weight_lag=lag,
    )


def _pace_check(settings: PaceSettings, batch_groups: int, lag: int) -> str | None:
    if settings.target_groups >= batch_groups:
        return None
    return (
        f"filter.pace.target_groups ({settings.target_groups}) must be >= loop.batch_groups "
        f"({batch_groups}): below one batch PACE rejects groups the trainer is waiting for"
    )


def _max_age_check(settings: MaxAgeSettings, batch_groups: int, lag: int) -> str | None:
    if settings.versions >= lag:
        return None
    return (
        f"filter.max_age.versions ({settings.versions}) must be >= loop.sync_interval - 1 ({lag}): between "
        "publications the engine's weights lag the trainer's by up to that many versions, so every "
        "group would be rejected"
    )


def _max_age_stall(settings: MaxAgeSettings, lag: int) -> str | None:
    if lag <= settings.versions:
        return None
    return (
        f"filter.max_age.versions={settings.versions} rejects every group (it must be >= "
        "loop.sync_interval - 1, the versions the engine's weights trail the trainer's between publications)"
    )


def _admission_check(settings: AdmissionSettings, batch_groups: int, lag: int) -> str | None:
    if settings.max_offpolicyness >= lag:
        return None
    return (
        f"filter.admission.max_offpolicyness ({settings.max_offpolicyness}) must be >= "
        f"loop.sync_interval - 1 ({lag}): between publications the trainer takes loop.sync_interval "
        "batches generated by one version, the last of them that many versions old, so staleness could "
        "not stay within it"
    )


def _admission_closed(
    settings: AdmissionSettings, pool: TrajectoryPool, steps: int, lag: int, batch: int
) -> str:
    cap = (settings.max_offpolicyness + steps - lag + 1) * batch
    return (
        f"it allows (filter.admission.max_offpolicyness + steps - weight lag + 1)·loop.batch_groups = {cap} "
        f"groups after {steps} steps with the engine {lag} versions behind, and {pool.accepted_groups} were "
        "accepted already; was the run resumed with a smaller loop.batch_groups?"
    )


_BUILT_IN: dict[str, StalenessFilter] = {
    "none": StalenessFilter(_positions(TrajectoryPool._keep_all), reason=""),
    "max_age": StalenessFilter(
        _positions(TrajectoryPool._max_age),
        reason="max_age",
        settings=MaxAgeSettings,
        section="max_age",
        check=_max_age_check,
        stall=_max_age_stall,
    ),
    "admission": StalenessFilter(
        _positions(TrajectoryPool._keep_all),
        reason="",
        settings=AdmissionSettings,
        section="admission",
        admission=_admission_gate,
        check=_admission_check,
        closed=_admission_closed,
    ),
    "pace": StalenessFilter(
        _positions(TrajectoryPool._pace),
        reason="pace_budget",
        settings=PaceSettings,
        section="pace",
        check=_pace_check,
    ),
}

FILTERS: Registry[StalenessFilter] = Registry(
    "filter", lambda found: found if isinstance(found, StalenessFilter) else None, "a StalenessFilter"
)
FILTERS.update(_BUILT_IN)
"""`filter.name` → the filter: the built-ins, and any a module adds with `register_filter`."""


def register_filter(name: str, chosen: StalenessFilter) -> None:
    """Make `chosen` usable as `filter.name=<name>` (a module that registers is named `module:name`, so
    that it is imported first)."""
    FILTERS.register(name, chosen)


def staleness_filter(name: str) -> StalenessFilter:
    """The filter named `name`: a registered one, or `module:attribute` (the module imported, the
    attribute a `StalenessFilter` or a name the module registered). A ValueError says what is wrong."""
    return FILTERS.lookup(name)
