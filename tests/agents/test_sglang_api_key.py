"""The SGLang client's API key: sent as `Authorization: Bearer <key>` on every request when
`SGLangOptions.api_key_env` names it, checked by the stand-in as SGLang's `--api-key` checks it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.engine.protocol import SamplingParams
from pacerl.agents.engine.sglang import SGLangEngine, SGLangOptions
from pacerl.agents.engine.sglang_protocol import SGLangRequestError
from tests.agents.helpers import tiny_moe
from tests.helpers import ThreadServer, record_http_requests
from tests.sglang_standin import create_standin_app

GREEDY = SamplingParams(max_new_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def keyed() -> Iterator[str]:
    """The URL of a stand-in started with `--api-key sglang-key`."""
    app = create_standin_app(
        EmbeddedEngine(tiny_moe()), enable_return_routed_experts=False, api_key="sglang-key"
    )
    with ThreadServer(app) as server:
        yield server.url


async def test_the_key_is_sent_on_every_request(keyed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACERL_TEST_SGLANG_KEY", "sglang-key")
    sent = record_http_requests(monkeypatch)
    engine = SGLangEngine(SGLangOptions(url=keyed, api_key_env="PACERL_TEST_SGLANG_KEY"))
    try:
        generation = await engine.generate([5, 6, 7], GREEDY)
        await engine.abort("nothing-running")
        assert await engine.health()
    finally:
        await engine.aclose()
    assert 1 <= len(generation.tokens) <= 4
    assert [request.url.path for request in sent] == ["/generate", "/abort_request", "/health_generate"]
    assert all(request.headers["Authorization"] == "Bearer sglang-key" for request in sent)


async def test_a_missing_or_wrong_key_is_refused_with_a_hint(
    keyed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = record_http_requests(monkeypatch)
    bare = SGLangEngine(SGLangOptions(url=keyed))
    try:
        assert await bare.health()  # SGLang lets /health* through without a key
        with pytest.raises(SGLangRequestError, match=r"HTTP 401\): Unauthorized \(sent no key") as refused:
            await bare.generate([5, 6, 7], GREEDY)
    finally:
        await bare.aclose()
    assert refused.value.status == 401
    assert all("Authorization" not in request.headers for request in sent)
    monkeypatch.setenv("PACERL_TEST_SGLANG_KEY", "not-the-key")
    wrong = SGLangEngine(SGLangOptions(url=keyed, api_key_env="PACERL_TEST_SGLANG_KEY"))
    try:
        with pytest.raises(SGLangRequestError, match=r"HTTP 401\): Unauthorized \(sent the key"):
            await wrong.generate([5, 6, 7], GREEDY)
    finally:
        await wrong.aclose()


def test_a_named_but_unset_variable_fails_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PACERL_TEST_SGLANG_KEY", raising=False)
    with pytest.raises(ValueError, match="PACERL_TEST_SGLANG_KEY"):
        SGLangEngine(SGLangOptions(api_key_env="PACERL_TEST_SGLANG_KEY"))
