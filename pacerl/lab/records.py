"""What the simulator hands the real pool: finished episodes as `pacerl.agents.trajectory.Trajectory` records,
and the drift model PACE ranks them by.

Records hold synthetic token ids. With `token_block` > 1 one record token stands for that many real
tokens (segment lengths rounded, at least one), which keeps 30k-token trajectories cheap; the timing
and token accounting use exact counts, the staleness statistics the record's (block-rounded) ones.

**Prefix drift for PACE** (`DriftScorer`): F(τ) = u_τ · (token-mean version gap v_now − v_t), with
u_τ a per-trajectory sensitivity, lognormal(0, `drift_sigma`), fixed by a hash of the seed and the
trajectory id. Drift grows with the version gap; u_τ spreads trajectories of equal gap so PACE's
percentile ranking has something to rank. A model, not a measurement.
"""

from __future__ import annotations

import math
import statistics
import zlib
from collections.abc import Sequence
from typing import Any

from pacerl.agents.trajectory import Origin, Segment, Status, Trajectory
from pacerl.lab.state import Episode

_new_segment = Segment.__new__
_new_trajectory = Trajectory.__new__
_set_fields = object.__setattr__  # past the frozen dataclass's __setattr__


class RecordMaker:
    """Builds the records of finished episodes, `block` real tokens to a record token; segments of one
    length are validated once and copied after (segments are immutable)."""

    def __init__(self, block: int) -> None:
        self.block = block
        self._templates: dict[int, dict[str, Any]] = {}  # a validated model segment's fields, by length
        self._tool_segments: dict[int, Segment] = {}
        self._prompts: dict[int, Segment] = {}

    def blocks(self, tokens: int) -> int:
        """Record tokens standing for `tokens` real ones (at least one)."""
        return max(1, round(tokens / self.block)) if self.block > 1 else tokens

    def prompt(self, tokens: int) -> Segment:
        """The prompt segment a group's members share (one per length: segments are immutable)."""
        count = self.blocks(tokens)
        prompt = self._prompts.get(count)
        if prompt is None:
            prompt = self._prompts[count] = Segment(Origin.PROMPT, (0,) * count)
        return prompt

    def record(self, episode: Episode, prompt: Segment, version: int, now: float) -> Trajectory:
        """The finished episode as a real Trajectory (synthetic token ids; see `token_block`), completed
        at trainer version `version` and time `now`; the group's members share one prompt segment and
        tool segments of one length are shared too.

        Built without `Trajectory.__init__`, whose validation (a JSON round trip of `env_info` among
        it) was the largest cost of a run after the segments': the record holds exactly the fields
        the constructor would set (a test compares the two), and the checks below are those whose
        outcome depends on the simulation rather than on how this method builds the record."""
        group, block = episode.group, self.block
        segments = [prompt]
        append = segments.append
        tools, templates, tool_origin = self._tool_segments, self._templates, Origin.TOOL
        latest = 0
        for origin, tokens, seg_version, started, ended, reason in episode.parts:
            count = max(1, round(tokens / block)) if block > 1 else tokens
            if origin is tool_origin:
                tool = tools.get(count)
                if tool is None:
                    tool = tools[count] = Segment(Origin.TOOL, (2,) * count)
                append(tool)
                continue
            template = templates.get(count)
            if template is None:
                validated = Segment(Origin.MODEL, (1,) * count, (-1.0,) * count, 0, 0.0, 0.0, "stop")
                template = templates[count] = validated.__dict__
            if not (seg_version >= 0 and 0.0 <= started <= ended and reason):
                raise RuntimeError(
                    f"invalid simulated segment: v{seg_version} [{started}, {ended}] {reason!r}"
                )
            # Segment's constructor re-validates every token and log-prob; a copy of a validated
            # template's fields of this length keeps them and sets the four fields checked above
            # (frozen: the copy becomes the instance dict, as the dataclass's __init__ fills it)
            fields = template.copy()
            fields["version"], fields["started_at"], fields["ended_at"] = seg_version, started, ended
            fields["finish_reason"] = reason
            segment = _new_segment(Segment)
            _set_fields(segment, "__dict__", fields)
            append(segment)
            if seg_version > latest:
                latest = seg_version
        if not (version >= latest and math.isfinite(now)):
            raise RuntimeError(f"invalid simulated record: completed at v{version} (latest v{latest}), {now}")
        record = _new_trajectory(Trajectory)
        record.__dict__ = {
            "id": f"{group.id}-{episode.index}",
            "group_id": group.id,
            "task_id": group.id,
            "segments": tuple(segments),
            "status": Status.COMPLETED,
            "status_reason": "answered",
            "reward": 0.0,
            "env_info": {},
            "completed_version": version,
            "completed_at": now,
        }
        return record


class DriftScorer:
    """The PACE drift model (module docstring) of one run: `seed` fixes each trajectory's sensitivity,
    `sigma` their log-space spread."""

    def __init__(self, seed: int, sigma: float) -> None:
        self.seed, self.sigma = seed, sigma
        self._normal = statistics.NormalDist()
        self._prefix = zlib.crc32(f"{seed}:".encode())  # crc32 of "seed:id" continues from it

    def __call__(self, trajectories: Sequence[Trajectory], version: int) -> list[float]:
        """Sensitivity × token-mean version gap at trainer version `version`, one score a trajectory."""
        scores = []
        prefix, inv_cdf, sigma = self._prefix, self._normal.inv_cdf, self.sigma
        for trajectory in trajectories:
            lag = tokens = 0
            for segment in trajectory.segments:
                if segment.version is not None:
                    count = len(segment.tokens)
                    lag += (version - segment.version) * count
                    tokens += count
            z = inv_cdf((zlib.crc32(trajectory.id.encode(), prefix) + 0.5) / 2**32)
            scores.append(math.exp(sigma * z) * lag / tokens if tokens else 0.0)
        return scores
