"""AgentWorkflow: runs an agent (any object with `run(self, data, **extra_kwargs)`) as a rollout workflow.

Per episode: open a proxy session, run the agent against the proxy (inline in the worker's loop or, with
`agent_hosts`, in one of the worker's agent host processes; or in a pooled process), close the session, turn the
agent's return value into per-completion rewards and export the recorded completions as trajectories. The agent
needs no change but its base URL and API key.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any

import rollq.tracing as tracing
from rollq.engine.types import InferenceEngine
from rollq.protocol.messages import AgentOptions
from rollq.workers.agents.agent_user import new_folder_path, parse_agent_user, remove_folder
from rollq.workers.agents.command import is_command
from rollq.workers.agents.export import AgentOutputError, assign_rewards, export
from rollq.workers.agents.subproc import agent_result, extra_kwargs_for, run_agent
from rollq.workers.context import workflow_context
from rollq.workers.environments.naming import is_environment
from rollq.workers.resolver import active_allowlist
from rollq.workers.rewards.processes import AsyncRewardWrapper, RewardError, RewardNotANumber, RewardTimeout


class AgentTimeout(Exception):
    """The episode ran longer than the agent options' timeout_seconds."""


class AgentWorkflow:
    def __init__(self, target: Any, path: str, kwargs: dict[str, Any] | None, options: AgentOptions | None) -> None:
        self.target = target  # the agent class (built lazily, inline mode only) or an agent object
        self.path = path
        self.kwargs = kwargs or {}
        self.options = options or AgentOptions()
        self._agent: Any = None

    def _inline_agent(self) -> Any:
        if self._agent is None:
            self._agent = self.target(**self.kwargs) if inspect.isclass(self.target) else self.target
        return self._agent

    async def arun_episode(self, engine: InferenceEngine, data: Any) -> list[dict[str, Any]] | None:
        ctx = workflow_context()
        proxy = await ctx.proxy(engine)
        opts = self.options
        session = proxy.sessions.open({"max_tokens": opts.max_tokens} if opts.max_tokens else None)
        episode = workflow_context.get()  # the proxy's requests run outside the episode: the session carries it
        session.priority = episode.priority
        session.lora = episode.lora or None
        session.tracing = tracing.active()  # its completions' spans: children of this episode's
        session.traceparent = tracing.traceparent() if session.tracing is not None else ""
        urls = {"base_url": proxy.base_url, "anthropic_base_url": proxy.root_url}
        try:
            if opts.mode == "inline":
                result = await self._run_inline(ctx, data, urls, session.key)
            else:
                result = await self._run_subproc(ctx, data, urls, session.key)
        finally:
            proxy.sessions.close(session)
        records = session.ordered()
        if result is None:  # the agent rejected the sample (as arun_episode returning None does)
            return None
        with tracing.span("reward", attributes={"rollq.completions": len(records)}) as span:
            assign_rewards(records, result)
            if isinstance(result, int | float):
                span.set_attribute("rollq.reward", float(result))
        return export(records, opts.export_style, opts.turn_discount)

    async def _run_inline(self, ctx: Any, data: Any, urls: dict[str, str], key: str) -> Any:
        agent = self._inline_agent()
        offered = {**urls, "api_key": key}
        if inspect.iscoroutinefunction(agent.run):
            # A command agent (an environment is one) is its own process already, built here: never re-resolved in
            # a host by its path.
            if ctx.config.agent_hosts > 0 and not (is_command(self.path) or is_environment(self.path)):
                return await self._run_hosted(ctx, data, urls, key)
            offered["http_client"] = ctx.agent_http_client()  # httpx or httpx2: what the installed SDKs take
            call = agent.run(data, **extra_kwargs_for(agent.run, offered))
        else:  # a synchronous agent: a thread, so the loop (and the proxy it talks to) keeps running
            call = asyncio.to_thread(agent.run, data, **extra_kwargs_for(agent.run, offered))
        try:
            return await asyncio.wait_for(call, self.options.timeout_seconds)
        except TimeoutError:
            raise AgentTimeout(f"agent {self.path} ran longer than {self.options.timeout_seconds:g}s") from None

    async def _run_hosted(self, ctx: Any, data: Any, urls: dict[str, str], key: str) -> Any:
        """An async agent's episode in one of the worker's agent host processes (rollq.workers.agents.hosts)."""
        from rollq.workers.agents.hosts import AgentHosts, AgentHostStuck

        timeout = self.options.timeout_seconds
        hosts = ctx.pool(("agent-hosts",), lambda: AgentHosts(ctx.config.agent_hosts, ctx.config))
        kwargs_json = json.dumps(self.kwargs, sort_keys=True)
        try:
            reply = await hosts.run(
                self.path, kwargs_json, data, urls, key, active_allowlist(), workflow_context.get(), timeout
            )
        except AgentHostStuck as exc:
            raise AgentTimeout(f"agent {self.path} ran longer than {timeout:g}s; {exc}") from None
        tag = reply[0]
        if tag == "ok":
            return reply[3]
        if tag == "timeout":
            raise AgentTimeout(f"agent {self.path} ran longer than {timeout:g}s")
        if tag == "bad":
            raise AgentOutputError(
                f"agent {self.path} returned {reply[2]} {reply[3]}: a reward must be a finite number, a "
                "{completion_id: reward} mapping or None"
            )
        _, _, type_name, text, tb = reply
        # The agent's own exception, with the host's traceback in the message so the dead letter shows it.
        raise AgentError(f"agent {self.path} raised {type_name}: {text}\n{tb}".rstrip())

    async def _run_subproc(self, ctx: Any, data: Any, urls: dict[str, str], key: str) -> Any:
        timeout = self.options.timeout_seconds
        pool = ctx.pool(
            ("agents", timeout),
            lambda: AsyncRewardWrapper(
                run_agent,
                timeout_seconds=timeout,
                max_workers=ctx.config.agent_processes,
                max_retries=0,  # an agent that ran out of time is not run again
                accept=agent_result,
                what="agent",
                expected="a reward or a {completion_id: reward} mapping",
            ),
        )
        # The episode's own working directory: made by the child (as the agents' user), removed here afterwards
        # whatever happened to the child.
        workdir = new_folder_path()
        user = ctx.config.agent_user
        try:
            kind, value = await pool(
                self.path, json.dumps(self.kwargs, sort_keys=True), data, urls, key, active_allowlist(), workdir, user
            )
        except RewardTimeout as exc:
            raise AgentTimeout(f"agent {self.path}: {exc}") from None
        except RewardNotANumber as exc:
            raise AgentOutputError(str(exc)) from None
        except RewardError as exc:
            # The agent's own exception, with the child's traceback in the message so the dead letter shows it.
            raise AgentError(f"{exc}\n{exc.remote_traceback}".rstrip()) from None
        finally:
            remove = asyncio.to_thread(remove_folder, workdir, parse_agent_user(user))
            await asyncio.shield(asyncio.ensure_future(remove))
        return value


class AgentError(Exception):
    """The agent raised (subproc mode and agent hosts; inline agents' exceptions in the worker's loop propagate as
    they are)."""


def is_agent(obj: Any) -> bool:
    return callable(getattr(obj, "run", None)) and getattr(obj, "arun_episode", None) is None


__all__ = ["AgentError", "AgentTimeout", "AgentWorkflow", "is_agent"]
