"""Tools: typed functions with a sandbox policy, registered by name. Importing this registers the
built-in ones (`python`, `search`)."""

from envs.tools import python, search
from envs.tools.core import TOOLS, SandboxPolicy, Tool, ToolContext, ToolError, get_tool, make_tool, tool

__all__ = [
    "TOOLS",
    "SandboxPolicy",
    "Tool",
    "ToolContext",
    "ToolError",
    "get_tool",
    "make_tool",
    "python",
    "search",
    "tool",
]
