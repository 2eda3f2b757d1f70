"""SGLang's native HTTP API as the SGLang engine (`pacerl.agents.engine.sglang`) speaks it: the errors, the
transport (bounded retries, the API key), the request bodies and the checks on every answer.

Written against sglang 0.5.23 (see `pacerl.agents.engine.sglang`), from these files of it:

- `python/sglang/srt/entrypoints/http_server.py`: the routes (`POST /generate`, `POST /abort_request`
  answering 200 with no body, `POST /pause_generation` and `/continue_generation` answering
  `{"message", "status": "ok"}`, `POST /update_weights_from_disk` answering `{"success", "message",
  "num_paused_requests"}` with HTTP 400 when `success` is false, `GET /health_generate` answering 200
  or 503 after generating one token, `GET /model_info` with `/get_model_info` its deprecated alias),
  and the error bodies: 400 `{"error": {"message"}}` for a refused generation, 400 `{"object": "error",
  "message", ...}` for a body that does not parse, 400 `{"error": "..."}` from the JSON contract gate.
- `python/sglang/srt/managers/io_struct.py`: `GenerateReqInput` (`input_ids`, `sampling_params`, `rid`,
  `return_logprob`, `logprob_start_len` (-1: no prompt log-probs), `return_routed_experts`),
  `UpdateWeightFromDiskReqInput` (`model_path`, `load_format`, `abort_all_requests`, `weight_version`),
  `AbortReq` (`rid`, `abort_all`), `PauseGenerationReqInput` (`mode`: abort | retract | in_place).
- `python/sglang/srt/managers/tokenizer_manager.py`: the answer `{"text", "output_ids", "meta_info"}`
  whose `meta_info` holds `id`, `finish_reason`, `prompt_tokens`, `completion_tokens`,
  `weight_version`, `output_token_logprobs` (`[logprob, token_id, text-or-None]` per generated token)
  and `routed_experts`; `pause_generation(mode="abort")` aborts every request, waits until none is
  left, and holds new ones until `continue_generation`; a request aborted while running comes back
  normally (HTTP 200) with its partial output and `finish_reason.type == "abort"`; `abort_request`
  aborts every request whose rid *starts with* the given one.
- `python/sglang/srt/managers/schedule_batch.py`: finish reasons `{"type": "stop", "matched": id or
  text}`, `{"type": "length", "length"}`, `{"type": "abort", "message", "status_code", "err_type"}`.
- `python/sglang/srt/sampling/sampling_params.py`: `top_k=-1` turns top-k off (0 is an error),
  temperature below 1e-6 is greedy, at most 32 stop strings, `sampling_seed`, `no_stop_trim`.
- `python/sglang/srt/layers/sampler.py`: the returned log-probs are `log_softmax(logits / T)` *before*
  top-k/top-p truncation (greedy: `log_softmax(logits)`), so they are the behaviour log-probs only
  while no truncation is on (see `SGLangOptions.allow_untruncated_logprobs`).
- `python/sglang/srt/utils/weight_versions.py`: `meta_info["weight_versions"]` spans
  `{"version", "start", "end"}` over the output tokens when the weights changed mid-request.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from pacerl.agents.engine.protocol import FinishReason, SamplingParams

MAX_STOP_STRINGS = 32
"""SGLang's `MAX_STOP_COUNT`: more stop strings are refused by the server."""

_RETRY_STATUS = frozenset({500, 502, 503, 504})
_OVERFLOW = re.compile(r"longer than the model's context length|exceeds the model's maximum context length")


class SGLangError(RuntimeError):
    """A failure talking to an SGLang server."""


class SGLangUnavailable(SGLangError):  # noqa: N818 (the name the rollout side catches)
    """The server could not be reached, or gave no answer in time, after the allowed retries."""


class SGLangRequestError(SGLangError):
    """The server refused a request (HTTP 4xx, or a weight update it reported as failed)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class SGLangProtocolError(SGLangError):
    """The server's answer is not what SGLang 0.5.23 sends (or lacks something pacerl asked for)."""


def auth_headers(api_key_env: str | None) -> dict[str, str]:
    """`Authorization: Bearer <key>` with the key in the environment variable `api_key_env`; none
    without a name, and a `ValueError` for a name that is unset."""
    if not api_key_env:
        return {}
    key = os.environ.get(api_key_env, "")
    if not key:
        raise ValueError(f"SGLangOptions.api_key_env names {api_key_env!r}, but that variable is unset")
    return {"Authorization": f"Bearer {key}"}


class Transport:
    """HTTP calls to one SGLang server at `url`, with bounded retries (see `request`)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float,
        retries: int,
        backoff_s: float,
        max_connections: int,
        headers: dict[str, str],
    ) -> None:
        self.base = url.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        self.headers = headers
        self.client: httpx.AsyncClient | None = None
        """Built on first use (`http`) so that its connections belong to the loop that runs the requests."""

    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            limit = self.max_connections
            self.client = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
                headers=self.headers,
            )
        return self.client

    async def request(
        self, method: str, path: str, body: dict[str, Any] | None, timeout_s: float, *, repeatable: bool
    ) -> httpx.Response:
        """One call with bounded retries. A connection that never opened is retried for any call;
        a dropped connection or HTTP 5xx only for `repeatable` calls (a repeated /generate would run
        twice). Returns the last response; raises `SGLangUnavailable` when none came."""
        url = self.base + path
        budget = httpx.Timeout(timeout_s, connect=self.connect_timeout_s)
        deadline = self.connect_timeout_s + timeout_s
        failure = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with asyncio.timeout(deadline):
                    response = await self.http().request(method, url, json=body, timeout=budget)
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:
                failure = f"cannot connect to the SGLang server at {url}: {describe_error(error)}"
                continue
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as error:
                failure = f"the SGLang server at {url} dropped the connection: {describe_error(error)}"
                if repeatable:
                    continue
                raise SGLangUnavailable(failure) from error
            except (TimeoutError, httpx.TimeoutException) as error:
                raise SGLangUnavailable(
                    f"the SGLang server at {url} gave no answer within {deadline:g} s"
                ) from error
            if response.status_code in _RETRY_STATUS and repeatable:
                text = error_text(response)
                failure = f"the SGLang server at {url} answered HTTP {response.status_code}: {text}"
                continue
            return response
        raise SGLangUnavailable(f"{failure} (gave up after {self.retries + 1} attempts)")

    async def get_json(self, path: str, older: str, timeout_s: float) -> tuple[str, Any]:
        """GET `path` (`older`, its name on servers older than 0.5.23, where it is missing): the path
        that answered, and its answer."""
        response = await self.request("GET", path, None, timeout_s, repeatable=True)
        if response.status_code == 404:
            path = older
            response = await self.request("GET", path, None, timeout_s, repeatable=True)
        if response.status_code != 200:
            raise self.refused(path, response)
        return path, json_answer(response, self.base + path)

    async def answers(self, path: str, limit_s: float) -> bool:
        """Whether GET `path` answers 200 within `limit_s`; False on any failure, never an exception."""
        try:
            async with asyncio.timeout(limit_s):
                response = await self.http().get(
                    self.base + path,
                    timeout=httpx.Timeout(limit_s, connect=min(limit_s, self.connect_timeout_s)),
                )
        except (httpx.HTTPError, TimeoutError):
            return False
        return response.status_code == 200

    def refused(self, path: str, response: httpx.Response) -> SGLangError:
        text, status, where = error_text(response), response.status_code, self.base + path
        if status >= 500:
            return SGLangUnavailable(f"the SGLang server at {where} failed: HTTP {status}: {text}")
        if status == 401:
            sent = "the key" if self.headers else "no key"
            text += f" (sent {sent}: does SGLangOptions.api_key_env name the server's --api-key?)"
        return SGLangRequestError(
            f"the SGLang server at {where} refused the request (HTTP {status}): {text}", status
        )

    def outcome(self, path: str, response: httpx.Response) -> tuple[bool, str]:
        """Whether a call answering `{"success", "message"}` succeeded, and its message; an HTTP 5xx
        is `refused`."""
        if response.status_code >= 500:
            raise self.refused(path, response)
        where = self.base + path
        answer = json_answer(response, where)
        if not isinstance(answer, dict) or not isinstance(answer.get("success"), bool):
            raise SGLangProtocolError(f"{where} answered {brief(answer)}, not {{success, message}}")
        return response.status_code == 200 and answer["success"], str(answer.get("message", "(no message)"))

    async def aclose(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.aclose()


# -- requests ------------------------------------------------------------------------------------------


def prompt_ids(input_ids: Sequence[int]) -> list[int]:
    """`input_ids` as the plain ints of a `/generate` body; a `ValueError` for anything else."""
    prompt = list(input_ids)
    if not prompt:
        raise ValueError("input_ids is empty")
    for token in prompt:
        if isinstance(token, bool) or not isinstance(token, int | np.integer) or token < 0:
            raise ValueError(f"input_ids must be non-negative ints, got {token!r}")
    return [int(token) for token in prompt]


def sampling_params(sampling: SamplingParams, *, allow_untruncated_logprobs: bool) -> dict[str, Any]:
    """SGLang's `sampling_params` for `sampling`; what SGLang would refuse fails here, first."""
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
    truncated = sampling.top_p < 1 or sampling.top_k > 0
    if sampling.temperature > 0 and truncated and not allow_untruncated_logprobs:
        raise ValueError(
            "SGLang returns log-probs before top-k/top-p truncation, not those of the distribution "
            f"sampled from (top_p={sampling.top_p}, top_k={sampling.top_k}); use top_p=1 and top_k=0, "
            "or set SGLangOptions.allow_untruncated_logprobs=True to accept them"
        )
    if len(sampling.stop_strings) > MAX_STOP_STRINGS:
        raise ValueError(
            f"SGLang takes at most {MAX_STOP_STRINGS} stop strings, got {len(sampling.stop_strings)}"
        )
    if sampling.seed is not None and not -(2**63) <= sampling.seed < 2**63:
        raise ValueError(f"seed must fit in a signed 64-bit int, got {sampling.seed}")
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        # The raw tokens are what is trained on; keep special tokens and stop strings in the text too.
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if sampling.ignore_eos:
        params["ignore_eos"] = True
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.stop_strings:
        params["stop"] = list(sampling.stop_strings)
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    return params


def is_overflow(message: str) -> bool:
    """Whether a refused generation's message says the prompt exceeds the model's context."""
    return _OVERFLOW.search(message) is not None


# -- answers -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """A checked `/generate` answer."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish: FinishReason
    routed_experts: Any
    """`meta_info.routed_experts` as sent (checked by `pacerl.agents.engine.sglang_layout.decode_routes`)."""


def parse_answer(answer: Any, prompt_len: int, sent_version: int, where: str) -> Answer:
    """Check a `/generate` answer to a prompt of `prompt_len` tokens sent while this client's
    version was `sent_version` (see `token_versions`)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
        raise SGLangProtocolError(f"{where} answered without a meta_info object")
    meta: dict[str, Any] = answer["meta_info"]
    finish = finish_reason(meta.get("finish_reason"), where)
    tokens = int_list(answer.get("output_ids"), "output_ids", where)
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list) or len(entries) != len(tokens):
        raise SGLangProtocolError(
            f"{where}: meta_info.output_token_logprobs must hold one entry per output token "
            f"({len(tokens)}), got {brief(entries)}"
        )
    logprobs = []
    for position, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
        if not isinstance(entry, list) or len(entry) < 2 or entry[1] != token:
            raise SGLangProtocolError(
                f"{where}: output_token_logprobs[{position}] should be [logprob, {token}, text], "
                f"got {entry!r}"
            )
        value = entry[0]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise SGLangProtocolError(f"{where}: output_token_logprobs[{position}] has logprob {value!r}")
        logprobs.append(float(value))
    for key, expected in (("completion_tokens", len(tokens)), ("prompt_tokens", prompt_len)):
        if key in meta and meta[key] != expected:
            raise SGLangProtocolError(f"{where}: meta_info.{key} is {meta[key]!r}, expected {expected}")
    versions = token_versions(meta, len(tokens), sent_version, where)
    return Answer(tuple(tokens), tuple(logprobs), versions, finish, meta.get("routed_experts"))


def finish_reason(value: Any, where: str) -> FinishReason:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("stop", "length", "abort"):
        raise SGLangProtocolError(
            f"{where}: meta_info.finish_reason must be {{'type': 'stop' | 'length' | 'abort', ...}}, "
            f"got {value!r}"
        )
    return FinishReason(str(kind))


def int_list(value: Any, what: str, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise SGLangProtocolError(f"{where}: {what} must be a list of token ids, got {brief(value)}")
    return value


def version_number(name: Any) -> int | None:
    """A weight_version as an int, or None when it is not one (SGLang's default is "default")."""
    if isinstance(name, str) and re.fullmatch(r"-?\d+", name.strip()):
        return int(name)
    return None


def token_versions(meta: dict[str, Any], count: int, sent_version: int, where: str) -> tuple[int, ...]:
    """The version of each of `count` output tokens: the server's (its spans when the weights changed
    mid-request) when it is an integer, else `sent_version`."""
    spans = meta.get("weight_versions")
    if isinstance(spans, list) and spans:
        versions: list[int] = []
        for span in spans:
            number = version_number(span.get("version")) if isinstance(span, dict) else None
            if number is None:
                break
            start, end = span.get("start"), span.get("end")
            if start != len(versions) or not isinstance(end, int) or end < start:
                raise SGLangProtocolError(f"{where}: meta_info.weight_versions are not contiguous: {spans!r}")
            versions.extend([number] * (end - start))
        else:
            if len(versions) != count:
                raise SGLangProtocolError(
                    f"{where}: meta_info.weight_versions cover {len(versions)} of {count} output tokens"
                )
            return tuple(versions)
    number = version_number(meta.get("weight_version"))
    return (sent_version if number is None else number,) * count


def positive_int(config: dict[str, Any], *keys: str) -> int | None:
    """The first of `keys` that `config` holds as an int >= 1, else None."""
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def json_answer(response: httpx.Response, url: str) -> Any:
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SGLangProtocolError(
            f"{url} answered HTTP {response.status_code} with a body that is not JSON: {error}"
        ) from None


def error_text(response: httpx.Response) -> str:
    """The message of any of SGLang's error bodies, else the body's start."""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        for candidate in (error, body.get("message"), body.get("detail")):
            if isinstance(candidate, str):
                return candidate
    return json.dumps(body)[:500]


def brief(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, dict | list | str | int | float | None) else repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def describe_error(error: Exception) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
