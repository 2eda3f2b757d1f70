"""Progress on the terminal: a bar with a status text, or log lines when there is no terminal."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import Self

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

log = logging.getLogger(__name__)


class ProgressDisplay:
    """A progress bar labelled `label` with a status text on a terminal; without one (CI logs, pipes) a
    log line at the first step, every `log_every` steps (default: a tenth of the total) and at the last."""

    def __init__(
        self, label: str, total: int, done: int, *, log_every: int | None = None, unit: str = "step"
    ) -> None:
        self.interactive = sys.stderr.isatty()
        self.label, self.total, self.unit = label, total, unit
        self.log_every = log_every or max(1, total // 10)
        self.progress = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            disable=not self.interactive,
        )
        self.task = self.progress.add_task(label, total=total, completed=done, status="")

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def show(self, step: int, status: str) -> None:
        self.progress.update(self.task, completed=step, status=status)
        if not self.interactive and (step in (1, self.total) or step % self.log_every == 0):
            log.info("%s %s %d/%d  %s", self.label, self.unit, step, self.total, status)


class StepDisplay(ProgressDisplay):
    """The training bar: the step's reward, accuracy, staleness and pool occupancy; one log line per
    step without a terminal."""

    def __init__(self, total: int, done: int) -> None:
        super().__init__("train", total, done, log_every=1)

    def update(self, step: int, scalars: Mapping[str, float]) -> None:
        self.show(
            step,
            f"reward {scalars.get('reward', 0.0):.2f}  acc {scalars.get('accuracy', 0.0):.2f}  "
            f"staleness {scalars.get('staleness/mean_staleness', 0.0):.2f}  "
            f"pool {scalars.get('pool_groups', 0.0):.0f}  v{scalars.get('version', 0.0):.0f}",
        )


class EpisodeDisplay(ProgressDisplay):
    """An evaluation's bar: episodes done of `total`, the generated tokens/s and the time left; a log
    line at the first episode, every tenth of them and the last without a terminal."""

    def __init__(self, label: str, total: int) -> None:
        super().__init__(label, total, 0, unit="episode")
        self.done, self.tokens = 0, 0
        self.started = time.monotonic()

    def episode(self, generated_tokens: int) -> None:
        """One more episode ended, having generated `generated_tokens`."""
        self.done += 1
        self.tokens += generated_tokens
        elapsed = max(time.monotonic() - self.started, 1e-9)
        left = elapsed / self.done * (self.total - self.done)
        self.show(self.done, f"{self.tokens / elapsed:.1f} tokens/s  {left:.0f} s left")
