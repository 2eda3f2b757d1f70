"""Gymnasium environments for tool use, their tools, parsing, rewards and tasks.

Importing `envs` registers every environment with a versioned id:

    import gymnasium, envs
    env = gymnasium.make("pacerl/CodeMath-v0")

This package imports only `sandbox` from the project.
"""

import gymnasium

from envs.base import EpisodeLost, ToolEnv, ToolEnvConfig
from envs.parsing import Parsed, ParseError, ToolCall, extract_boxed, extract_tag, parse_actions
from envs.registry import env_class, tool_env_ids
from envs.rewards import Reward
from envs.spaces import ChatMessages, Message, UnicodeText
from envs.tasks import Task, load_tasks
from envs.tools import TOOLS, SandboxPolicy, Tool, ToolContext, ToolError, get_tool, tool

ENV_IDS = ("pacerl/CodeMath-v0", "pacerl/Search-v0", "pacerl/Math-v0", "pacerl/SearchR1-v0")
"""Every environment this package registers (a user's module registers its own: `env_class`)."""

for _env_id, _entry_point in zip(
    ENV_IDS,
    ("envs.code_math:CodeMathEnv", "envs.search:SearchEnv", "envs.math:MathEnv", "envs.search:SearchR1Env"),
    strict=True,
):
    if _env_id not in gymnasium.registry:
        gymnasium.register(id=_env_id, entry_point=_entry_point, disable_env_checker=False)

__all__ = [
    "ENV_IDS",
    "TOOLS",
    "ChatMessages",
    "EpisodeLost",
    "Message",
    "ParseError",
    "Parsed",
    "Reward",
    "SandboxPolicy",
    "Task",
    "Tool",
    "ToolCall",
    "ToolContext",
    "ToolEnv",
    "ToolEnvConfig",
    "ToolError",
    "UnicodeText",
    "env_class",
    "extract_boxed",
    "extract_tag",
    "get_tool",
    "load_tasks",
    "parse_actions",
    "tool",
    "tool_env_ids",
]
