"""Agent workflows: any object with `run(self, data, **extra_kwargs)`, run against the recording proxy."""

from workers.agents.export import AgentOutputError, assign_rewards, export
from workers.agents.runner import AgentError, AgentTimeout, AgentWorkflow

__all__ = ["AgentError", "AgentOutputError", "AgentTimeout", "AgentWorkflow", "assign_rewards", "export"]
