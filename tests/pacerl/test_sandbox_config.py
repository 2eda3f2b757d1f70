"""The python tool's sandbox from the run config (`env.sandbox`): backend and limits reach the tool."""

from __future__ import annotations

import json

import pytest

from pacerl.assembly import env_factory
from pacerl.config import ConfigError, SandboxSpec, load_config
from pacerl.envs.tools import SandboxPolicy, get_tool
from pacerl.envs.tools.core import SANDBOX_POLICIES
from pacerl.envs.tools.python import PYTHON_POLICY


def _python_call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


def test_the_default_sandbox_is_the_tools_own() -> None:
    spec = SandboxSpec()
    assert spec.backend == PYTHON_POLICY.backend and spec.limits() == PYTHON_POLICY.limits


def test_a_configured_timeout_and_output_cap_reach_the_python_tool() -> None:
    config = load_config(
        None, ["env.sandbox.backend=local", "env.sandbox.timeout_s=1", "env.sandbox.output_cap_bytes=100"]
    )
    env = env_factory(config)()
    try:
        env.reset(seed=0)
        # Under the tool's own 10 s this sleep ends with no output; under the configured 1 s it times out.
        observation, _, _, _, info = env.step(_python_call("import time\ntime.sleep(5)\nprint('woke')"))
        text = observation[0]["content"]
        assert "[timeout: wall-clock limit of 1 s exceeded]" in text and "woke" not in text, text
        assert info["error"]
        observation, *_ = env.step(_python_call("print('x' * 5000)"))
        text = observation[0]["content"]
        kept, marker = text.split("\n", 1)
        assert kept == "x" * 100 and "4901 more bytes truncated" in marker, text
    finally:
        env.close()


def test_backend_options_reach_the_backend() -> None:
    config = load_config(None, ["env.sandbox.options.warm_pool=0"])
    policy = env_factory(config)().config.settings[SANDBOX_POLICIES]["python"]
    assert policy == SandboxPolicy("local", config.env.sandbox.limits(), {"warm_pool": 0})
    assert get_tool("python").policy_in({SANDBOX_POLICIES: {"python": policy}}) is policy


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("env.sandbox.backend=kubernetes", "env.sandbox.backend"),
        ("env.sandbox.timeout_s=0", "timeout_s"),
        ("env.sandbox.memory_mb=1", "memory_mb"),
        ("env.sandbox.timeout=3", "env.sandbox.timeout"),
        ("env.sandbox.options.no_such_option=1", "no option no_such_option"),
        ("env.sandbox.backend=docker", None),
    ],
)
def test_bad_sandbox_settings_are_refused_at_load(override: str, named: str | None) -> None:
    if named is None:  # a good one, for contrast: the docker backend is checked without its daemon
        assert load_config(None, [override]).env.sandbox.backend == "docker"
        return
    with pytest.raises(ConfigError, match=named):
        load_config(None, [override])
