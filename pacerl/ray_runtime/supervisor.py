"""Bringing lost actors back: the `Supervisor` of a set of actors (engine replicas, environment
workers) and the `FaultLog` of every recovery. It imports no torch: `pacerl.ray_runtime.envs`, which
every environment worker imports, uses it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import ActorDiedError, RayActorError

if TYPE_CHECKING:  # pacerl.config imports torch
    from pacerl.config import RaySpec

log = logging.getLogger(__name__)


class ReplicasLostError(Exception):  # not a RuntimeError: the driver would retry it per request
    """Every engine replica (or environment worker) is dead and out of restarts: the run cannot go on."""


class FaultLog:
    """Counts of what the runtime recovered from (the run's `faults`) and one line per event in
    `faults.jsonl`, naming the actor and, where one was hit, the trajectory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.counts: Counter[str] = Counter()
        self._resumed: set[str] = set()

    def event(self, kind: str, **details: Any) -> None:
        self.counts[kind] += 1
        line = {"time": time.time(), "event": kind, **details}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as file:
            file.write(json.dumps(line) + "\n")

    def resumed(self, trajectory_id: str | None, **details: Any) -> None:
        """A request of `trajectory_id` was lost with its actor and is being sent again."""
        if trajectory_id is not None and trajectory_id not in self._resumed:
            self._resumed.add(trajectory_id)
            self.counts["trajectories_resumed"] += 1
        self.event("engine_request_retried", trajectory=trajectory_id, **details)


class Slot:
    """One supervised actor: its current handle, whether it may take work, and its load."""

    def __init__(self, index: int, name: str, handle: Any) -> None:
        self.index, self.name, self.handle = index, name, handle
        self.generation = 0
        """Actors that have held this slot before the current one (replacements)."""
        self.ready = True
        self.dead = False
        self.outstanding = 0
        self.assigned = 0
        self.lock = asyncio.Lock()
        self.recovering: asyncio.Future[None] | None = None


class Supervisor:
    """Brings lost actors back: waits for one that is only unreachable to answer again, replaces one
    that is gone (a crash, `ray.kill`, a lost node), then `prepare`s it (an engine loads the current
    weights); a slot out of restarts is dead. `pick` waits for a ready slot.

    Ray's own actor restarts stay off: a restarted engine would come back with the weights it was
    created with, and Ray cannot hand it the current ones; a replacement is created with them."""

    def __init__(
        self,
        kind: str,
        slots: list[Slot],
        spawn: Callable[[Slot], Any],
        prepare: Callable[[Slot], Awaitable[None]],
        spec: RaySpec,
        faults: FaultLog,
    ) -> None:
        self.kind, self.slots, self.spawn, self.prepare = kind, slots, spawn, prepare
        self.spec, self.faults = spec, faults
        self._changed = asyncio.Event()

    async def pick(self, prefer: Slot | None = None) -> Slot:
        """`prefer` if it is ready, else the ready slot with the fewest outstanding calls."""
        while True:
            changed = self._changed
            if prefer is not None and prefer.ready:
                return prefer
            ready = [slot for slot in self.slots if slot.ready]
            if ready:
                chosen = min(ready, key=lambda slot: (slot.outstanding, slot.assigned))
                chosen.assigned += 1
                return chosen
            if all(slot.dead for slot in self.slots):
                raise ReplicasLostError(f"every {self.kind} actor died and used up ray.max_restarts")
            await changed.wait()

    def lost(self, slot: Slot, error: BaseException) -> None:
        """A call to `slot` failed because its actor is gone or not ready: recover it (once)."""
        if not slot.ready or slot.dead:
            return
        slot.ready = False
        log.warning("%s lost: %s", slot.name, brief(error))
        self.faults.event(f"{self.kind}_lost", actor=slot.name, error=brief(error))
        slot.recovering = asyncio.ensure_future(self._recover(slot))

    async def _recover(self, slot: Slot) -> None:
        replace = False
        try:
            while True:
                if not replace and await self._answers(slot):  # only unreachable for a while
                    self.faults.event(f"{self.kind}_reconnected", actor=slot.name)
                else:
                    with quiet():
                        ray.kill(slot.handle)
                    if slot.generation >= self.spec.max_restarts:
                        slot.dead = True
                        self.faults.event(f"{self.kind}_out_of_restarts", actor=slot.name)
                        return
                    slot.generation += 1
                    slot.handle = self.spawn(slot)
                    self.faults.event(f"{self.kind}_replaced", actor=slot.name, generation=slot.generation)
                try:
                    await asyncio.wait_for(self.prepare(slot), self.spec.restart_timeout_s)
                except (RayActorError, TimeoutError) as error:  # died again, or never came up
                    log.warning("%s lost again while recovering: %s", slot.name, brief(error))
                    replace = True
                    continue
                slot.ready = True
                return
        finally:
            self._notify()

    async def _answers(self, slot: Slot) -> bool:
        """True when the actor answers, False when it is gone or did not answer in `restart_timeout_s`."""
        deadline = time.monotonic() + self.spec.restart_timeout_s
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(slot.handle.ping.remote(), deadline - time.monotonic())
                return True
            except ActorDiedError:
                return False
            except RayActorError:  # unavailable (a network partition): calls fail fast until it is back
                await asyncio.sleep(0.2)
            except TimeoutError:
                return False
        return False

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def aclose(self) -> None:
        for slot in self.slots:
            if slot.recovering is not None:
                slot.recovering.cancel()
            with quiet():
                ray.kill(slot.handle)
        pending = [slot.recovering for slot in self.slots if slot.recovering is not None]
        await asyncio.gather(*pending, return_exceptions=True)


def quiet() -> contextlib.suppress:
    """For best-effort calls to an actor that may be gone (killing it, aborting on it)."""
    return contextlib.suppress(RayActorError)


def brief(error: BaseException) -> str:
    """The first line of an error (Ray's carry the remote traceback below it)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
