"""The trajectory record, the one currency between rollout and training (docs/design.md, "The trajectory
record"): a prompt plus ordered segments, each a run of tokens of one origin. Every model segment carries
the policy version that generated it, so per-token versions, the loss mask and the staleness terms of
PACE and SAT (docs/algorithms.md §2, §6) are derived from the record alone.

An interrupted generation that resumes under new weights is a new model segment with the new version.

Routes (R3) cover the whole sequence: every segment may carry the routed experts of its tokens, the
row of token t being the routing of the forward whose input was t − 1 (`pacerl.agents.routing`). A model
segment's rows come with its tokens; the prompt's (all its tokens but the first, which no forward
produced) and a tool response's come from the prefill of the engine call that follows them, and are
attached then (`attach_routes`). Record format 2 (`RECORD_FORMAT`); format 1, written before routes
of prompt and tool tokens were recorded, still loads: its routes cover model tokens only.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from pacerl.agents.routing import RoutedExperts


class Origin(enum.StrEnum):
    """Who wrote a segment's tokens."""

    PROMPT = "prompt"
    MODEL = "model"
    TOOL = "tool"


class Status(enum.StrEnum):
    """Where a trajectory stands; every status but `running` is final."""

    RUNNING = "running"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


def _int_tuple(name: str, values: Sequence[int] | npt.NDArray[np.integer[Any]]) -> tuple[int, ...]:
    array = np.asarray(values)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence, got shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name} must be integers, got dtype {array.dtype}")
    if array.min() < 0:
        raise ValueError(f"{name} must be >= 0, got {array.min()}")
    return tuple(array.tolist())


def _float_tuple(name: str, values: Sequence[float] | npt.NDArray[np.floating[Any]]) -> tuple[float, ...]:
    # float32 widens to float64 exactly, so engine log-probs keep their exact values.
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or not np.isfinite(array).all():
        raise ValueError(f"{name} must be a 1-D sequence of finite floats")
    return tuple(array.tolist())


def _check_number(name: str, value: object, *, integer: bool = False, minimum: float | None = None) -> None:
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if number is None or (integer and not isinstance(number, int)) or not math.isfinite(number):
        raise ValueError(f"{name} must be a finite {'int' if integer else 'number'}, got {value!r}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")


RECORD_FORMAT = 2
"""The trajectory JSON format `Trajectory.to_json` writes. 2: routes may cover prompt and tool
segments too. 1 (no `format` key): routes on model segments only; still read."""

_MODEL_FIELDS = ("logprobs", "version", "started_at", "ended_at", "finish_reason")
_SEGMENT_KEYS = {"origin", "tokens", "routed_experts", *_MODEL_FIELDS}


@dataclass(frozen=True)
class Segment:
    """A contiguous run of tokens of one origin; a model segment also records how it was generated."""

    origin: Origin
    """`prompt` (first segment only), `model` (generated, trainable) or `tool` (masked out of the loss)."""
    tokens: tuple[int, ...]
    """Token ids, at least one (sequences and integer arrays are accepted and stored as a tuple)."""
    logprobs: tuple[float, ...] | None = None
    """Model only: behaviour log-probs log π_behav(token), one finite float per token."""
    version: int | None = None
    """Model only: the policy version of the weights that generated every token of this segment."""
    started_at: float | None = None
    """Model only: `time.time()` when this generation began (or resumed)."""
    ended_at: float | None = None
    """Model only: `time.time()` when it stopped; not before `started_at`."""
    finish_reason: str | None = None
    """Model only: why it stopped, e.g. `stop`, `length`, `tool_call`, or `abort` when new weights
    interrupted it (the rest then follows as a new segment)."""
    routed_experts: RoutedExperts | None = None
    """For R3: one row per token, the routing of the forward pass that produced it (see
    `pacerl.agents.routing`); the prompt has none for its first token, so `len(tokens) - 1` rows. A model
    segment's rows are those the engine decoded it with; a prompt's or tool response's, those of the
    prefill of the next engine call."""

    def __post_init__(self) -> None:
        if not isinstance(self.origin, Origin):
            raise ValueError(f"origin must be an Origin, got {self.origin!r}")
        object.__setattr__(self, "tokens", _int_tuple("tokens", self.tokens))
        routes = self.routed_experts
        if routes is not None and (not isinstance(routes, RoutedExperts) or len(routes) != self.route_rows):
            raise ValueError(
                f"routed_experts of a {self.origin} segment of {len(self.tokens)} tokens must be "
                f"RoutedExperts with {self.route_rows} rows, got {routes!r}"
            )
        if self.origin is not Origin.MODEL:
            present = [name for name in _MODEL_FIELDS if getattr(self, name) is not None]
            if present:
                raise ValueError(f"a {self.origin} segment has no {', '.join(present)}")
            return
        missing = [name for name in _MODEL_FIELDS if getattr(self, name) is None]
        if missing or self.logprobs is None:
            raise ValueError(f"a model segment needs {', '.join(missing)}")
        logprobs = _float_tuple("logprobs", self.logprobs)
        if len(logprobs) != len(self.tokens):
            raise ValueError(f"{len(logprobs)} logprobs for {len(self.tokens)} tokens")
        object.__setattr__(self, "logprobs", logprobs)
        _check_number("version", self.version, integer=True, minimum=0)
        _check_number("started_at", self.started_at)
        _check_number("ended_at", self.ended_at, minimum=self.started_at)
        if not isinstance(self.finish_reason, str) or not self.finish_reason:
            raise ValueError(f"finish_reason must be a non-empty string, got {self.finish_reason!r}")

    @property
    def route_rows(self) -> int:
        """Rows a complete `routed_experts` has: one per token, the prompt's first token excepted."""
        return len(self.tokens) - int(self.origin is Origin.PROMPT)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON; floats are written by `repr`, which reads back bit-exactly."""
        data: dict[str, Any] = {"origin": self.origin.value, "tokens": list(self.tokens)}
        if self.origin is Origin.MODEL:
            data.update({name: getattr(self, name) for name in _MODEL_FIELDS})
            data["logprobs"] = list(data["logprobs"])
        if self.routed_experts is not None:
            data["routed_experts"] = self.routed_experts.to_json()
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Segment:
        """The inverse of `to_json`."""
        if not {"origin", "tokens"} <= set(data) <= _SEGMENT_KEYS:
            raise ValueError(
                f"segment JSON needs origin and tokens, may have {_MODEL_FIELDS}; got {sorted(data)}"
            )
        routes = data.get("routed_experts")
        logprobs = data.get("logprobs")
        return cls(
            origin=Origin(data["origin"]),
            tokens=tuple(data["tokens"]),
            logprobs=None if logprobs is None else tuple(logprobs),
            version=data.get("version"),
            started_at=data.get("started_at"),
            ended_at=data.get("ended_at"),
            finish_reason=data.get("finish_reason"),
            routed_experts=None if routes is None else RoutedExperts.from_json(routes),
        )


@dataclass
class Trajectory:
    """One episode as the rollout driver records it.

    Mutable while `running`, because the driver that owns it appends a segment per engine call and per
    tool response; `finish` seals it, and from then on appending or finishing again raises, so the pool
    and the trainer read a record that no longer changes. Derived arrays are computed on each access.
    """

    id: str
    """Unique id of this trajectory."""
    group_id: str
    """The group it belongs to (trajectories of one prompt, for group-relative advantages)."""
    task_id: str
    """The task it attempts."""
    segments: tuple[Segment, ...]
    """The segments in order; the first, and only it, is the prompt."""
    status: Status = Status.RUNNING
    """`running` until `finish`, then final."""
    status_reason: str = ""
    """Why it ended with this status (e.g. `answered`, `max_turns`, the error message)."""
    reward: float | None = None
    """The episode's reward; required for `completed` and `truncated`, optional otherwise."""
    env_info: dict[str, Any] = field(default_factory=dict)
    """The env's info, stored as plain JSON types (a JSON round trip is applied on validation)."""
    completed_version: int | None = None
    """v_done: the engine's policy version when it finished; None while running."""
    completed_at: float | None = None
    """`time.time()` when it finished; None while running."""

    def __post_init__(self) -> None:
        for name in ("id", "group_id", "task_id"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        if not isinstance(self.segments, tuple) or not all(isinstance(s, Segment) for s in self.segments):
            raise ValueError("segments must be a tuple of Segment")
        origins = [segment.origin for segment in self.segments]
        if not origins or origins[0] is not Origin.PROMPT or Origin.PROMPT in origins[1:]:
            raise ValueError(f"the first segment, and only it, must be the prompt; got {origins}")
        _check_routes(self.segments)
        if not isinstance(self.status, Status) or not isinstance(self.status_reason, str):
            raise ValueError(f"status must be a Status and status_reason a str, got {self.status!r}")
        try:
            self.env_info = json.loads(json.dumps(self.env_info, allow_nan=False))
        except (TypeError, ValueError) as error:
            raise ValueError(f"env_info must be JSON-serializable: {error}") from error
        if not isinstance(self.env_info, dict):
            raise ValueError(f"env_info must be a dict, got {type(self.env_info).__name__}")
        if self.status is Status.RUNNING:
            if (self.reward, self.completed_version, self.completed_at) != (None, None, None):
                raise ValueError("a running trajectory has no reward, completed_version or completed_at")
            return
        latest = max((s.version for s in self.segments if s.version is not None), default=0)
        _check_number("completed_version", self.completed_version, integer=True, minimum=latest)
        _check_number("completed_at", self.completed_at)
        if self.reward is not None:
            _check_number("reward", self.reward)
            self.reward = float(self.reward)
        elif self.status in (Status.COMPLETED, Status.TRUNCATED):
            raise ValueError(f"a {self.status} trajectory needs a reward")

    # -- building (the rollout driver) -------------------------------------------------------------------

    @classmethod
    def start(
        cls, id: str, group_id: str, task_id: str, prompt_tokens: Sequence[int] | npt.NDArray[np.integer[Any]]
    ) -> Trajectory:
        """A running trajectory holding only its prompt."""
        prompt = Segment(Origin.PROMPT, _int_tuple("prompt_tokens", prompt_tokens))
        return cls(id=id, group_id=group_id, task_id=task_id, segments=(prompt,))

    def append_model(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer[Any]],
        logprobs: Sequence[float] | npt.NDArray[np.floating[Any]],
        *,
        version: int,
        started_at: float,
        ended_at: float,
        finish_reason: str,
        routed_experts: RoutedExperts | None = None,
    ) -> Segment:
        """Append one generation call's output (a resumed generation is a new call, hence a new segment)."""
        segment = Segment(
            Origin.MODEL,
            _int_tuple("tokens", tokens),
            _float_tuple("logprobs", logprobs),
            version,
            started_at,
            ended_at,
            finish_reason,
            routed_experts,
        )
        return self._append(segment)

    def append_tool(self, tokens: Sequence[int] | npt.NDArray[np.integer[Any]]) -> Segment:
        """Append an environment response (tool output, chat-template glue): kept out of the loss."""
        return self._append(Segment(Origin.TOOL, _int_tuple("tokens", tokens)))

    def _append(self, segment: Segment) -> Segment:
        self._require_running("append to")
        _check_routes((*self.segments, segment))
        self.segments = (*self.segments, segment)
        return segment

    def finish(
        self,
        status: Status,
        *,
        reason: str,
        reward: float | None,
        completed_version: int,
        completed_at: float,
        env_info: Mapping[str, Any] | None = None,
    ) -> None:
        """Seal the trajectory with a final status; validated as a whole before anything changes."""
        self._require_running("finish")
        if status is Status.RUNNING:
            raise ValueError("finish needs a final status, not running")
        done = dataclasses.replace(
            self,
            status=status,
            status_reason=reason,
            reward=reward,
            env_info=dict(env_info or {}),
            completed_version=completed_version,
            completed_at=completed_at,
        )
        self.status, self.status_reason, self.reward = done.status, done.status_reason, done.reward
        self.env_info, self.completed_version, self.completed_at = (
            done.env_info,
            done.completed_version,
            done.completed_at,
        )

    def _require_running(self, action: str) -> None:
        if self.status is not Status.RUNNING:
            raise RuntimeError(f"cannot {action} trajectory {self.id!r}: it is already {self.status}")

    # -- derived views (aligned with `tokens`) -----------------------------------------------------------

    def _lengths(self) -> npt.NDArray[np.int64]:
        return np.array([len(segment.tokens) for segment in self.segments], dtype=np.int64)

    @property
    def tokens(self) -> npt.NDArray[np.int64]:
        """All token ids, segments concatenated."""
        return np.concatenate([np.asarray(segment.tokens, dtype=np.int64) for segment in self.segments])

    @property
    def prompt_length(self) -> int:
        """Tokens in the prompt segment."""
        return len(self.segments[0].tokens)

    @property
    def response_length(self) -> int:
        """Tokens after the prompt, model and tool alike."""
        return int(self._lengths().sum()) - self.prompt_length

    @property
    def loss_mask(self) -> npt.NDArray[np.bool_]:
        """True for model tokens (trained on), False for prompt and tool tokens."""
        is_model = np.array([s.origin is Origin.MODEL for s in self.segments], dtype=np.bool_)
        return np.repeat(is_model, self._lengths())

    @property
    def token_versions(self) -> npt.NDArray[np.int64]:
        """The policy version that generated each token; -1 for prompt and tool tokens."""
        versions = np.array([-1 if s.version is None else s.version for s in self.segments], dtype=np.int64)
        return np.repeat(versions, self._lengths())

    @property
    def behaviour_logprobs(self) -> npt.NDArray[np.float64]:
        """log π_behav per token; 0.0 for prompt and tool tokens (masked out)."""
        parts = [
            np.zeros(len(s.tokens)) if s.logprobs is None else np.asarray(s.logprobs) for s in self.segments
        ]
        return np.concatenate(parts)

    @property
    def num_model_tokens(self) -> int:
        """Trainable tokens."""
        return int(self.loss_mask.sum())

    @property
    def num_turns(self) -> int:
        """Assistant turns: runs of consecutive model segments (a resumed generation continues its turn)."""
        origins = [segment.origin for segment in self.segments]
        return sum(o is Origin.MODEL and p is not Origin.MODEL for p, o in itertools.pairwise(origins))

    @property
    def versions(self) -> tuple[int, ...]:
        """The distinct versions of the model segments, in order of first appearance."""
        return tuple(dict.fromkeys(s.version for s in self.segments if s.version is not None))

    def _route_spans(self) -> list[tuple[int, Segment]]:
        """(first token position with a row, segment) per segment: its start, the prompt's plus one."""
        starts = np.cumsum(self._lengths()) - self._lengths()
        return [
            (int(start) + int(s.origin is Origin.PROMPT), s)
            for start, s in zip(starts, self.segments, strict=True)
        ]

    def routed_experts(self) -> tuple[npt.NDArray[np.int64], RoutedExperts] | None:
        """The recorded routes of the whole sequence as `(positions, routes)`: the ascending token
        positions whose segment recorded routes and their rows; None when nothing was recorded. A
        record of this format covers every position but 0 up to the last token generated (a trailing
        tool response, never followed by an engine call, has none); a format-1 record covers its model
        tokens only. The row of position t is the routing of the forward whose input was t − 1, so the
        trainer replays it at input position `positions - 1`; inputs without a row keep the live
        router."""
        found = [
            (first, s.routed_experts) for first, s in self._route_spans() if s.routed_experts is not None
        ]
        if not found:
            return None
        positions = np.concatenate([np.arange(first, first + len(routes)) for first, routes in found])
        return positions.astype(np.int64), RoutedExperts.concat([routes for _, routes in found])

    @property
    def routed_length(self) -> int:
        """n such that the rows of tokens 1..n (input positions 0..n−1) are recorded, segment by
        segment from the prompt on: what the next engine call passes as `routed_experts_start_len`."""
        covered = 0
        for first, segment in self._route_spans():
            if segment.routed_experts is None:
                break
            covered = first + len(segment.routed_experts) - 1
        return covered

    def attach_routes(self, routes: RoutedExperts, start: int) -> int:
        """Record the rows of input positions `[start, start + len(routes))` (tokens `start + 1` ..
        `start + len(routes)`) that an engine's prefill computed: every segment without routes whose
        tokens they cover gets its rows; segments that have routes keep them. Returns how many segments
        got rows. A segment without routes covered only in part is a ValueError (misaligned rows)."""
        self._require_running("attach routes to")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be an int >= 0, got {start!r}")
        end = start + 1 + len(routes)  # rows of tokens [start + 1, end)
        if end > len(self.tokens):
            raise ValueError(
                f"{len(routes)} rows from input position {start} run past the {len(self.tokens)} tokens"
            )
        segments = list(self.segments)
        attached = 0
        for index, (first, segment) in enumerate(self._route_spans()):
            last = first + segment.route_rows  # the segment's rows are those of tokens [first, last)
            if segment.routed_experts is not None:
                continue
            if start + 1 <= first and last <= end:
                rows = routes[first - start - 1 : last - start - 1]
                segments[index] = dataclasses.replace(segment, routed_experts=rows)
                attached += 1
            elif first < end and start + 1 < last:
                raise ValueError(
                    f"rows of tokens [{start + 1}, {end}) cover only part of the {segment.origin} segment "
                    f"of tokens [{first}, {last})"
                )
        _check_routes(segments)
        self.segments = tuple(segments)
        return attached

    # -- staleness (docs/algorithms.md §6) ------------------------------------------------------------

    def _model_versions(self) -> npt.NDArray[np.int64]:
        versions = self.token_versions
        return versions[versions >= 0]

    def _done_version(self) -> int:
        if self.completed_version is None:
            raise RuntimeError(f"trajectory {self.id!r} is {self.status}: staleness needs a finished one")
        return self.completed_version

    def generation_staleness(self) -> float:
        """GS = mean over model tokens of (v_done − v_t): versions spanned while generating."""
        v_done = self._done_version()
        versions = self._model_versions()
        if versions.size == 0:
            raise ValueError(f"trajectory {self.id!r} has no model tokens: its staleness is undefined")
        return float(np.mean(v_done - versions))

    def waiting_staleness(self, v_now: int) -> int:
        """WS = v_now − v_done: trainer versions passed since it finished."""
        v_done = self._done_version()
        if v_now < v_done:
            raise ValueError(
                f"trainer version {v_now} is behind the version {v_done} that finished {self.id!r}"
            )
        return v_now - v_done

    def staleness(self, v_now: int) -> float:
        """S = GS + WS = mean over model tokens of (v_now − v_t)."""
        return self.generation_staleness() + self.waiting_staleness(v_now)

    def token_staleness(self, v_now: int) -> npt.NDArray[np.int64]:
        """v_now − v_t for each model token in order (for histograms); its mean is `staleness(v_now)`."""
        self.waiting_staleness(v_now)
        return v_now - self._model_versions()

    # -- serialization -----------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types, format `RECORD_FORMAT`; `from_json(to_json())` equals the original exactly."""
        data: dict[str, Any] = {"format": RECORD_FORMAT}
        data.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        data["status"] = self.status.value
        data["segments"] = [segment.to_json() for segment in self.segments]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Trajectory:
        """The inverse of `to_json`, validated; also reads format 1 (no `format` key)."""
        fields = dict(data)
        version = fields.pop("format", 1)
        if version not in (1, RECORD_FORMAT) or isinstance(version, bool):
            raise ValueError(
                f"trajectory record format {version!r} is not one this pacerl reads (1 or {RECORD_FORMAT}); "
                "it was written by another version of pacerl"
            )
        expected = {f.name for f in dataclasses.fields(cls)}
        if set(fields) != expected:
            raise ValueError(f"trajectory JSON needs exactly {sorted(expected)}; got {sorted(fields)}")
        segments = tuple(Segment.from_json(segment) for segment in fields["segments"])
        if version == 1 and any(
            s.origin is not Origin.MODEL and s.routed_experts is not None for s in segments
        ):
            raise ValueError("a format-1 trajectory record has routes on model segments only")
        return cls(**{**fields, "status": Status(fields["status"]), "segments": segments})


def _check_routes(segments: Sequence[Segment]) -> None:
    # One model, one routing geometry: mixed shapes would make the sequence's routes unreplayable.
    shapes = {(r.num_experts, r.num_layers, r.top_k) for s in segments if (r := s.routed_experts) is not None}
    if len(shapes) > 1:
        raise ValueError(f"segments disagree on routed experts (experts, layers, top_k): {sorted(shapes)}")
