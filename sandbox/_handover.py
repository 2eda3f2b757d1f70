"""Runs waiting in line for a sandbox that another task is resetting or starting: the local and Docker
backends' pools hand a sandbox over to the first run still waiting, or tell it that none is coming."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TypeVar

_Box = TypeVar("_Box")


async def wait_in_line(
    waiting: deque[asyncio.Future[_Box | None]], give_back: Callable[[_Box], None]
) -> _Box | None:
    """Wait at the end of `waiting` for a sandbox handed over (`hand_over`); None: none is coming, the
    caller starts one itself. A run cancelled just after a sandbox was handed to it gives that one back
    (`give_back`), so none is lost."""
    future: asyncio.Future[_Box | None] = asyncio.get_running_loop().create_future()
    waiting.append(future)
    try:
        return await future
    except asyncio.CancelledError:
        if future in waiting:
            waiting.remove(future)
        elif future.done() and not future.cancelled() and (unused := future.result()) is not None:
            give_back(unused)
        raise


def hand_over(waiting: deque[asyncio.Future[_Box | None]], box: _Box | None) -> bool:
    """Give `box` (None: word that none is coming) to the first run still waiting; False if none waits."""
    while waiting:
        future = waiting.popleft()
        if not future.done():
            future.set_result(box)
            return True
    return False
