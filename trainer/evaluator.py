"""Evaluation beside the training loop: snapshots of the trained weights scored on held-out tasks by a
second engine while training goes on (`Run.after_step` hook), and at the start and end of a run."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.evaluation.config import EvalConfig
from pacerl.agents.evaluation.play import evaluate
from pacerl.envs import Task, ToolEnv
from pacerl.trainer.loop import Run

log = logging.getLogger(__name__)


class BackgroundEvaluator:
    """Scores snapshots of the trained weights on held-out tasks with its own engine while training goes
    on; each result is written to the run's metrics as `eval/*` at the step it started, labelled with
    the policy version it evaluated."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        tokenizer: PreTrainedTokenizerBase,
        make_env: Callable[[], ToolEnv],
        tasks: Sequence[Task],
        settings: EvalConfig,
        *,
        every: int,
        num_experts: int = 0,
        extra_tasks: Mapping[str, Sequence[Task]] | None = None,
    ) -> None:
        self.engine = engine
        """The evaluator's own engine, holding a snapshot of the trained weights (never the trainer's)."""
        self.tokenizer = tokenizer
        self.make_env = make_env
        self.tasks = list(tasks)
        self.settings = settings
        self.every = every
        """Steps between background evaluations (0: only `now`)."""
        self.num_experts = num_experts
        self.extra_tasks = {name: list(tasks) for name, tasks in (extra_tasks or {}).items()}
        """Further held-out sets by name, each scored with the same weights and reported on its own as
        `eval/<name>/*` (e.g. question forms held out of training)."""
        if any(not name or "/" in name for name in self.extra_tasks):
            raise ValueError(
                f"extra evaluation set names must be non-empty without '/': {list(self.extra_tasks)}"
            )
        self.running: asyncio.Task[None] | None = None
        self.reports: list[dict[str, Any]] = []
        """One dict per evaluation: step, version and the `eval/*` scalars."""

    async def hook(self, run: Run) -> None:
        """After a step: start an evaluation of the current weights if one is due and none runs."""
        every = self.every
        due = every > 0 and run.step % every == 0 and run.step < run.config.steps
        if due and (self.running is None or self.running.done()):
            await self._snapshot(run)
            self.running = asyncio.ensure_future(self._evaluate(run, run.step))

    async def now(self, run: Run) -> None:
        """Evaluate the current weights and wait for the result (at the start and the end)."""
        if self.running is not None:
            await self.running
        await self._snapshot(run)
        await self._evaluate(run, run.step)

    async def _snapshot(self, run: Run) -> None:
        if run.learner.version > self.engine.version:
            await self.engine.update_weights(run.learner.weights(), run.learner.version)

    async def _evaluate(self, run: Run, step: int) -> None:
        version = self.engine.version
        scalars: dict[str, float] = {"eval/version": float(version)}
        for name, tasks in [("", self.tasks), *self.extra_tasks.items()]:
            report = await evaluate(
                self.engine,
                self.tokenizer,
                self.make_env,
                tasks,
                self.settings,
                num_experts=self.num_experts,
                label=f"step {step}, version {version}" + (f", {name}" if name else ""),
            )
            prefix = f"eval/{name}/" if name else "eval/"
            scalars |= {
                f"{prefix}accuracy": report.avg_at_k,
                f"{prefix}mean_reward": report.mean_reward,
                f"{prefix}tool_call_rate": report.tool_call_rate,
                **{f"{prefix}pass_at_{k}": value for k, value in report.pass_at_k.items()},
            }
            log.info(
                "eval at step %d (version %d)%s: accuracy %.3f",
                step,
                version,
                f" on {name}" if name else "",
                report.avg_at_k,
            )
        run.metrics.write(step, scalars)
        self.reports.append({"step": step, "version": version, **scalars})

    async def aclose(self) -> None:
        if self.running is not None:
            self.running.cancel()
            await asyncio.gather(self.running, return_exceptions=True)
        await self.engine.aclose()
