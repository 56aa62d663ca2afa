"""Command agents: an agent in any language, run as a process per episode (a job's workflow `exec:PROGRAM ARGS...`).

The contract, for the program:
- environment: a minimal one, never the worker's (rollq.workers.agents.environment): PATH, HOME and TMPDIR (a
  fresh folder per episode, removed after it), LANG and the worker's LC_* settings, OPENAI_BASE_URL (the recording
  proxy's base URL, ending /v1), OPENAI_API_KEY (the episode's session key), ANTHROPIC_BASE_URL (the proxy's root URL)
  and ANTHROPIC_API_KEY (the same key), and what the job passes as `workflow_kwargs: {"env": {NAME: value}}` (names
  the operator allowed with `env:NAME` patterns). The official SDKs read these, so an unmodified agent talks to the
  proxy and every completion is recorded token-exactly;
- working directory: its HOME, never the worker's (whose folders agents must not write to); as the worker's
  agent_user when set (rollq.workers.agents.agent_user): its one user, or with a uid range a uid of the episode's own
  (rollq.workers.agents.uid_pool), so no other running agent can read its environment;
- stdin: the job's data as one JSON document, then end of file;
- stdout: the LAST non-empty line is the result, as JSON: a number (the reward of the last completion), an object
  `{completion_id: reward}`, or `null` (the agent rejects the sample). Anything before that line is logged at debug
  level and otherwise ignored; a last line that is not such JSON fails the episode with an error quoting it;
- exit: 0. Any other exit status fails the episode with the status and the last 2 KiB of stderr;
- lifetime: the program runs in a process group (session) of its own. The group is killed (SIGKILL) at the episode
  timeout (AgentOptions.timeout_seconds), when the episode is cancelled, and when the program exits, so nothing the
  agent started in it outlives its episode. A process that left the group (setsid) survives that, unless the
  episode has a uid of its own (agent_user a range): then every process of that uid is killed when it ends.

`CommandAgent` is an ordinary inline agent (`async def run(...)`), so AgentWorkflow opens and closes the proxy
session, applies the timeout and turns the result into rewards and trajectories exactly as for a Python agent. It
never blocks the worker's loop: output is consumed as it arrives (a chatty agent never fills a pipe) and only the
last stdout line and the stderr tail are kept, so memory stays bounded whatever the program prints.

The allowlist: `parse_command` checks the program *as written* in the job (not its basename, which any file could
share) and the file it really is (symbolic links resolved) against the worker's `command:NAME` patterns, before
anything runs (`Allowlist.check_command` has the rules). `command:node` allows `exec:node a.js` (found on the
worker's PATH); `command:/opt/agents/*` allows any program named by a path under /opt/agents that is not a link out
of the allowed folders. A path with a `..` component is refused while an allowlist is active (it could leave an
allowed folder). The worker runs the very file it checked. Allowing a program allows it with any arguments and
whatever it runs in turn (`command:python3` allows `exec:python3 -c ...`). Without an active allowlist (trusted
local code) any command runs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping
from typing import Any, cast

import msgspec

from rollq.workers.agents.agent_user import (
    AgentUser,
    AgentUsers,
    enter_folder,
    new_folder_path,
    parse_agent_users,
    remove_folder,
)
from rollq.workers.agents.environment import command_environment, command_options, proxy_variables
from rollq.workers.agents.export import AgentOutputError
from rollq.workers.agents.subproc import agent_result
from rollq.workers.agents.uid_pool import UidPool, kill_uid
from rollq.workers.resolver import Allowlist, ImportNotAllowed, WorkflowLoadError

log = logging.getLogger("rollq.worker")

EXEC_PREFIX = "exec:"
STDERR_TAIL_BYTES = 2048  # how much of stderr an error carries
MAX_LINE_BYTES = 1 << 20  # the result line may be this long (a {completion_id: reward} object for many completions)
PIPE_DRAIN_S = 5.0  # after the group is killed, how long to wait for output still in the pipes


class CommandError(Exception):
    """The command could not start, exited with a non-zero status or was killed by a signal. `code`: its exit status
    (negative: the signal; None: it never ran), `stderr`: the tail of what it wrote there."""

    def __init__(self, message: str, *, code: int | None = None, stderr: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.stderr = stderr


def is_command(workflow: str) -> bool:
    return workflow.startswith(EXEC_PREFIX)


def parse_command(workflow: str, allowlist: Allowlist | None) -> list[str]:
    """`exec:PROGRAM ARGS...` -> argv (shell-style split, no shell runs), after the allowlist allowed PROGRAM.
    Raises WorkflowLoadError (malformed, not found) or ImportNotAllowed before anything runs."""
    return _parse(workflow, allowlist)[0]


def command_agent(workflow: str, kwargs: Mapping[str, Any], allowlist: Allowlist | None) -> CommandAgent:
    """The agent a job's `exec:` workflow and workflow_kwargs (`env`, see rollq.workers.agents.environment) name,
    after the allowlist allowed both; nothing has run yet."""
    argv, executable = _parse(workflow, allowlist)
    options = command_options(kwargs, allowlist)
    return CommandAgent(argv, workflow, executable=executable, env=options.env)


def _parse(workflow: str, allowlist: Allowlist | None) -> tuple[list[str], str]:
    """argv and the absolute path of the file to run (the one the allowlist checked)."""
    spec = workflow[len(EXEC_PREFIX) :] if is_command(workflow) else workflow
    try:
        argv = shlex.split(spec)
    except ValueError as exc:
        raise WorkflowLoadError(f"cannot split command {spec!r} shell-style: {exc}") from None
    if not argv:
        raise WorkflowLoadError(f"workflow {workflow!r} names no command: write 'exec:PROGRAM ARGS...'")
    program = argv[0]
    if allowlist is not None and ".." in program.split("/"):
        raise ImportNotAllowed(f"command {program!r} has a '..' path component; name it without one")
    found = shutil.which(program)
    if allowlist is not None:
        allowlist.check_command(program, found)
    if found is None:
        where = "is not an executable file" if "/" in program else "is not an executable on the worker's PATH"
        raise WorkflowLoadError(f"command {program!r} {where}")
    return argv, os.path.abspath(found)


class _Output(asyncio.SubprocessProtocol):
    """Consumes the program's stdout and stderr as they arrive, keeping the last stdout line and the stderr tail."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.last_line: bytes | None = None  # the last complete non-empty stdout line
        self.last_too_long = False  # the last line was longer than MAX_LINE_BYTES (its start was dropped)
        self._partial = bytearray()
        self._partial_too_long = False
        self.stderr_tail = bytearray()
        self.exited = asyncio.Event()  # the program (the group's leader) exited
        self.closed = asyncio.Event()  # the program exited and every pipe is closed

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        if fd == 2:
            self.stderr_tail += data
            del self.stderr_tail[:-STDERR_TAIL_BYTES]
            return
        *lines, rest = data.split(b"\n")
        for line in lines:
            self._partial += line
            self._line(bytes(self._partial), self._partial_too_long)
            self._partial.clear()
            self._partial_too_long = False
        self._partial += rest
        if len(self._partial) > MAX_LINE_BYTES:
            del self._partial[:-MAX_LINE_BYTES]
            self._partial_too_long = True

    def _line(self, line: bytes, too_long: bool) -> None:
        if not line.strip():
            return
        if self.last_line is not None and log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %s", self.name, self.last_line[:500].decode(errors="replace").rstrip())
        self.last_line, self.last_too_long = line, too_long

    def finish_stdout(self) -> None:
        if self._partial:
            self._line(bytes(self._partial), self._partial_too_long)
            self._partial.clear()

    def process_exited(self) -> None:
        self.exited.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.exited.set()
        self.closed.set()


class CommandAgent:
    """Runs `argv` once per episode against the recording proxy (see the module's docstring for the contract).

    `executable`: the file to run (what the allowlist checked; default: argv[0] as found on the worker's PATH), as
    argv[0]. `env`: variables the job passes (checked by `command_agent`). `user`: run it as this user (default:
    the worker's agent_user)."""

    def __init__(
        self,
        argv: list[str],
        name: str | None = None,
        *,
        executable: str | None = None,
        env: Mapping[str, str] | None = None,
        user: AgentUser | None = None,
        reads_result: bool = True,
    ) -> None:
        if not argv:
            raise ValueError("a command agent needs a program to run")
        self.argv = list(argv)
        self.name = name or EXEC_PREFIX + shlex.join(self.argv)
        self.executable = executable
        self.env = dict(env or {})
        self.user = user  # who runs it; None: the worker's agent_user (its own user when that is unset)
        # False: its exit status alone is its answer (a check), run() returns None and its stdout is not read.
        self.reads_result = reads_result

    async def run(self, data: Any, base_url: str, api_key: str, anthropic_base_url: str) -> Any:
        try:
            payload = msgspec.json.encode(data) + b"\n"
        except (TypeError, msgspec.EncodeError) as exc:
            raise AgentOutputError(f"{self.name}: the job's data cannot be written as JSON: {exc}") from None
        # Who runs it: `user`, the worker's one agent_user, or (agent_user a uid range) a uid of this episode's own
        # (waiting while none is free), which no other running agent has and so cannot read its environment.
        pool = None if self.user is not None else context_uid_pool()
        if pool is not None:
            user: AgentUser | None = await pool.acquire()
        else:
            user = self.user if self.user is not None else context_agent_user()
        # The episode's HOME, TMPDIR and working directory (never the worker's), removed after it. Made here as the
        # worker's user; with agent_user, by the program's process once it runs as that user, so the folder is its.
        home = tempfile.mkdtemp(prefix="rollq-agent-") if user is None else new_folder_path()
        try:
            if pool is not None and user is not None:
                await pool.ready(user)
            tmpdir = os.path.join(home, "tmp")
            if user is None:
                os.mkdir(tmpdir, 0o700)
            env = command_environment(home, tmpdir, proxy_variables(base_url, api_key, anthropic_base_url), self.env)
            return await self._run(payload, env, home, user)
        finally:
            # In a thread (an agent may leave a large tree), finished even when the episode is cancelled meanwhile.
            await asyncio.shield(asyncio.ensure_future(_end_episode(home, user, pool)))

    async def _run(self, payload: bytes, env: dict[str, str], home: str, user: AgentUser | None) -> Any:
        loop = asyncio.get_running_loop()
        out = _Output(self.name)
        # As another user: switched to (and its folders made) between fork and exec. uvloop's subprocess_exec takes
        # no user=/group=, so a preexec function does it; it makes only system calls.
        enter = None if user is None else functools.partial(_enter_episode, user, home, env["TMPDIR"])
        spawn = asyncio.ensure_future(
            loop.subprocess_exec(
                lambda: out,
                self.executable or self.argv[0],
                *self.argv[1:],
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                cwd=home if user is None else None,
                preexec_fn=enter,
                start_new_session=True,  # its own process group, killed as a whole
            )
        )
        try:
            transport, _ = await asyncio.shield(spawn)
        except (OSError, subprocess.SubprocessError) as exc:
            raise CommandError(f"{self.name}: cannot start {self.argv[0]!r}: {exc}") from None
        except asyncio.CancelledError:
            # Cancelled while the program was starting: it may run already (and have started others). The loop
            # kills only the leader of a spawn it abandons, so finish the spawn and kill the whole group.
            await _kill_started(spawn)
            raise
        pid = transport.get_pid()
        try:
            _write_stdin(transport, payload)
            await out.exited.wait()
            _kill_group(pid)  # what it left running dies with the episode (and lets go of the pipes)
            try:
                await asyncio.wait_for(out.closed.wait(), PIPE_DRAIN_S)
            except TimeoutError:  # a process that left the group holds a pipe: use what arrived
                log.warning("%s: output pipes still open %gs after the program exited", self.name, PIPE_DRAIN_S)
            code = transport.get_returncode()
        finally:
            if transport.get_returncode() is None:  # timed out or cancelled: kill the whole group, reap the leader
                _kill_group(pid)
                try:
                    await asyncio.wait_for(out.exited.wait(), PIPE_DRAIN_S)
                except TimeoutError:
                    log.warning("%s: pid %d did not exit %gs after SIGKILL", self.name, pid, PIPE_DRAIN_S)
            transport.close()
        if code != 0:
            stderr = out.stderr_tail.decode(errors="replace").strip()
            raise CommandError(f"{self.name} {_status(code)}; {_tail(out.stderr_tail)}", code=code, stderr=stderr)
        if not self.reads_result:
            return None
        out.finish_stdout()
        return self._result(out)

    def _result(self, out: _Output) -> Any:
        if out.last_line is None:
            raise AgentOutputError(
                f"{self.name} printed nothing on stdout: its last line must be its result as JSON (a reward, "
                "{completion_id: reward} or null)"
            )
        shown = out.last_line[:200].decode(errors="replace").strip() + ("..." if len(out.last_line) > 200 else "")
        if out.last_too_long:
            raise AgentOutputError(f"{self.name}: its last stdout line is longer than {MAX_LINE_BYTES} bytes")
        try:
            value = msgspec.json.decode(out.last_line)
        except msgspec.DecodeError:
            value = _NOT_JSON
        checked = None if value is _NOT_JSON else agent_result(value)
        if checked is None:
            raise AgentOutputError(
                f"{self.name}: its last stdout line must be JSON, a reward (a finite number), "
                f"{{completion_id: reward}} or null; it printed {shown!r}"
            )
        return checked[1]


_NOT_JSON = object()


def _write_stdin(transport: asyncio.SubprocessTransport, payload: bytes) -> None:
    """The data, buffered by the loop (a program that never reads stdin cannot block us), then end of file."""
    stdin = cast(asyncio.WriteTransport | None, transport.get_pipe_transport(0))  # uvloop's is no subclass
    if stdin is None or stdin.is_closing():
        return  # the program exited (or closed stdin) already; how it ended tells the rest
    try:
        stdin.write(payload)
        stdin.close()
    except (OSError, RuntimeError):  # closed under us (uvloop raises RuntimeError): same as above
        pass


def _enter_episode(user: AgentUser, home: str, tmpdir: str) -> None:
    """In the program's process, before exec: run as `user` in its own new HOME (and TMPDIR)."""
    enter_folder(home, user)
    os.mkdir(tmpdir, 0o700)


async def _end_episode(home: str, user: AgentUser | None, pool: UidPool | None) -> None:
    """HOME removed. With a uid of the episode's own, every process of that uid is killed first (one that left the
    group could still write into HOME, or wait for the uid's next episode), and the uid is freed last."""
    loop = asyncio.get_running_loop()
    if pool is None or user is None:
        await loop.run_in_executor(None, remove_folder, home, user)
        return
    clean = False
    try:
        clean = await loop.run_in_executor(None, kill_uid, user)
        await loop.run_in_executor(None, remove_folder, home, user)
    finally:
        pool.release(user, clean)


def context_agent_user() -> AgentUser | None:
    """The running worker's agent_user for command agents that share one (None outside a worker, or when agents
    run as the worker's user)."""
    users = _context_agent_users()
    return None if users is None else users.shared


def context_uid_pool() -> UidPool | None:
    """The running worker's pool of command-agent uids (agent_user a range), None when agents share one user."""
    from rollq.workers.context import workflow_context

    users = _context_agent_users()
    if users is None or not users.pooled:
        return None
    return cast(UidPool, workflow_context().pool(("agent-uids", str(users)), lambda: UidPool(users)))


def _context_agent_users() -> AgentUsers | None:
    from rollq.workers.context import workflow_context

    try:
        spec = workflow_context().config.agent_user
    except RuntimeError:  # no worker around this agent (a script, a test): its caller's user
        return None
    return parse_agent_users(spec)


async def _kill_started(spawn: asyncio.Future[Any]) -> None:
    """Kill the process group of a spawn whose caller was cancelled, once the spawn is done (bounded)."""
    try:
        transport, _ = await asyncio.wait_for(spawn, PIPE_DRAIN_S)
    except Exception:  # it failed to start, or never finished starting: nothing of ours to kill
        return
    _kill_group(transport.get_pid())
    transport.close()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _status(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _tail(stderr: bytearray) -> str:
    if not stderr.strip():
        return "stderr was empty"
    text = stderr.decode(errors="replace").strip()
    if len(stderr) >= STDERR_TAIL_BYTES:
        return f"stderr (its last {STDERR_TAIL_BYTES} bytes):\n{text}"
    return f"stderr:\n{text}"


__all__ = ["EXEC_PREFIX", "CommandAgent", "CommandError", "command_agent", "is_command", "parse_command"]
