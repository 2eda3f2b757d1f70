"""Progress on the terminal: a bar with what is done of how much, the rate, the time left and a status
text; log lines when there is no terminal."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import Self

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

log = logging.getLogger(__name__)


class ProgressDisplay:
    """A progress bar labelled `label` on stderr when it is a terminal: `step` of `total`, the time
    elapsed, then the status text, the rate and the time left (ETA). Without a terminal (CI logs, pipes)
    the same as one log line, `"{label} {unit} {step}/{total}  {status}  {rate}  ETA {h:mm:ss}"`, at the
    first step, every `log_every` steps (default: a tenth of the total) and at the last. The rate counts
    the steps since the display started (a resumed run's `done` steps are not its own); `clock` and
    `console` are for tests (a clock moved by hand, a console that is or is not a terminal)."""

    def __init__(
        self,
        label: str,
        total: int,
        done: int,
        *,
        log_every: int | None = None,
        unit: str = "step",
        clock: Callable[[], float] = time.monotonic,
        console: Console | None = None,
    ) -> None:
        self.interactive = console.is_terminal if console is not None else sys.stderr.isatty()
        self.label, self.total, self.unit = label, total, unit
        self.log_every = log_every or max(1, total // 10)
        self.clock, self.started, self.first = clock, clock(), done
        self.progress = Progress(
            TextColumn(f"[bold]{escape(label)}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}", markup=False),
            console=console if console is not None else Console(stderr=True),
            disable=not self.interactive,
        )
        self.task = self.progress.add_task(label, total=total, completed=done, status="")

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def pace(self, step: int) -> str:
        """The rate since the display started and the time left at it, e.g. `2.50 steps/s  ETA 0:01:04`
        (`s/step` below one step a second); `?` before the first step."""
        progressed, elapsed = step - self.first, self.clock() - self.started
        if progressed <= 0 or elapsed <= 0:
            return f"? {self.unit}s/s  ETA ?"
        rate = progressed / elapsed
        speed = f"{rate:.2f} {self.unit}s/s" if rate >= 1 else f"{1 / rate:.2f} s/{self.unit}"
        return f"{speed}  ETA {_hours(max(self.total - step, 0) / rate)}"

    def line(self, step: int, status: str) -> str:
        """The log line of `step` with `status`, as it reads now."""
        return "  ".join(
            part
            for part in (f"{self.label} {self.unit} {step}/{self.total}", status, self.pace(step))
            if part
        )

    def show(self, step: int, status: str) -> None:
        if self.interactive:
            self.progress.update(self.task, completed=step, status=f"{status}  {self.pace(step)}".lstrip())
        elif step in (1, self.total) or step % self.log_every == 0:
            log.info("%s", self.line(step, status))


class StepDisplay(ProgressDisplay):
    """The training bar: the step's reward, accuracy, staleness and pool occupancy; one log line per
    step without a terminal."""

    def __init__(
        self,
        total: int,
        done: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        console: Console | None = None,
    ) -> None:
        super().__init__("train", total, done, log_every=1, clock=clock, console=console)

    def update(self, step: int, scalars: Mapping[str, float]) -> None:
        self.show(
            step,
            f"reward {scalars.get('reward', 0.0):.2f}  acc {scalars.get('accuracy', 0.0):.2f}  "
            f"staleness {scalars.get('staleness/mean_staleness', 0.0):.2f}  "
            f"pool {scalars.get('pool_groups', 0.0):.0f}  v{scalars.get('version', 0.0):.0f}",
        )


class EpisodeDisplay(ProgressDisplay):
    """An evaluation's bar: episodes done of `total`, the generated tokens/s, the episode rate and the
    time left; a log line at the first episode, every tenth of them and the last without a terminal."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        console: Console | None = None,
    ) -> None:
        super().__init__(label, total, 0, unit="episode", clock=clock, console=console)
        self.done, self.tokens = 0, 0

    def episode(self, generated_tokens: int) -> None:
        """One more episode ended, having generated `generated_tokens`."""
        self.done += 1
        self.tokens += generated_tokens
        elapsed = self.clock() - self.started
        self.show(self.done, f"{self.tokens / elapsed:.1f} tokens/s" if elapsed > 0 else "? tokens/s")


def _hours(seconds: float) -> str:
    """`seconds` as h:mm:ss."""
    minutes, second = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{second:02d}"
