"""Tools: typed functions with a sandbox policy, registered by name. Importing this registers the
built-in ones (`python`, `search`); `mcp_tools` turns an MCP server's tools into more."""

from pacerl.envs.tools import python, search
from pacerl.envs.tools.core import (
    TOOLS,
    SandboxPolicy,
    Tool,
    ToolContext,
    ToolError,
    get_tool,
    make_tool,
    tool,
)
from pacerl.envs.tools.mcp import McpTool, mcp_tools

__all__ = [
    "TOOLS",
    "McpTool",
    "SandboxPolicy",
    "Tool",
    "ToolContext",
    "ToolError",
    "get_tool",
    "make_tool",
    "mcp_tools",
    "python",
    "search",
    "tool",
]
