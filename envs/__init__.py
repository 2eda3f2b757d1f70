"""Gymnasium environments for tool use, their tools, parsing, rewards and tasks.

Importing `envs` registers every environment with a versioned id:

    import gymnasium, envs
    env = gymnasium.make("pacerl/CodeMath-v0")

This package imports only `sandbox` from the project.
"""

import gymnasium

from pacerl.envs.base import EpisodeLost, ToolEnv, ToolEnvConfig
from pacerl.envs.parsing import Parsed, ParseError, ToolCall, extract_boxed, extract_tag, parse_actions
from pacerl.envs.registry import env_class, tool_env_ids
from pacerl.envs.rewards import Reward
from pacerl.envs.spaces import ChatMessages, Message, UnicodeText
from pacerl.envs.tasks import Task, load_tasks
from pacerl.envs.tools import TOOLS, SandboxPolicy, Tool, ToolContext, ToolError, get_tool, tool

ENV_IDS = (
    "pacerl/CodeMath-v0",
    "pacerl/Search-v0",
    "pacerl/Math-v0",
    "pacerl/SearchR1-v0",
    "pacerl/BFCL-MultiTurn-v0",
    "pacerl/ReasoningGym-v0",
    "pacerl/BFCL-AST-v0",
)
"""Every environment this package registers (a user's module registers its own: `env_class`)."""

for _env_id, _entry_point in zip(
    ENV_IDS,
    (
        "pacerl.envs.code_math:CodeMathEnv",
        "pacerl.envs.search:SearchEnv",
        "pacerl.envs.math:MathEnv",
        "pacerl.envs.search:SearchR1Env",
        "pacerl.envs.bfcl:BFCLMultiTurnEnv",
        "pacerl.envs.reasoning_gym:ReasoningGymEnv",
        "pacerl.envs.bfcl_ast:BFCLASTEnv",
    ),
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
