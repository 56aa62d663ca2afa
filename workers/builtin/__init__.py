"""Built-in workflows, selectable by a short agent name instead of an import path."""

from __future__ import annotations

from types import MappingProxyType

# Read-only: the name table is configuration, not state.
BUILTIN_WORKFLOWS = MappingProxyType(
    {
        "rlvr": "rollq.workers.builtin.rlvr:RLVRWorkflow",
        "vision_rlvr": "rollq.workers.builtin.vision_rlvr:VisionRLVRWorkflow",
        "multi_turn": "rollq.workers.builtin.multi_turn:MultiTurnWorkflow",
        "tool_agent": "rollq.workers.builtin.tool_agent:ToolAgentWorkflow",
    }
)


def resolve_agent_name(name: str) -> str:
    """A built-in agent name -> the import path of its workflow class."""
    try:
        return BUILTIN_WORKFLOWS[name]
    except KeyError:
        raise ValueError(f"unknown agent name {name!r}; known: {', '.join(sorted(BUILTIN_WORKFLOWS))}") from None


__all__ = ["BUILTIN_WORKFLOWS", "resolve_agent_name"]
