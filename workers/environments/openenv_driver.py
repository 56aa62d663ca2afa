"""rollq's OpenEnv driver: one episode of an OpenEnv environment, the policy's turns through rollq's recording proxy.

A standalone script run by the OpenEnv virtualenv's own Python (the worker's `openenv_python`), never importing
rollq: only the standard library, openenv and openai (openenv depends on it). rollq runs it as a command agent
(rollq.workers.environments.agent), so it has what every command agent has: a minimal environment, HOME (its
working directory) a fresh folder of the episode's, the worker's agent_user, its own process group killed when the
episode ends, OPENAI_BASE_URL / OPENAI_API_KEY the recording proxy and the episode's key.

`python openenv_driver.py --check [NAME]`: exits 0 when openenv can be imported, else prints one line
naming the problem on stderr and exits 3.

`python openenv_driver.py`: reads the payload, one JSON document on stdin:
    {"name": NAME, "kwargs": {...}, "data": {...}, "server": URL or COMMAND}
- `server`: what the operator's `openenv_servers` setting gives NAME (never the job): an `http(s)://` URL of a
  server the operator runs, used as it is; or a command line (split shell-style, no shell runs) that starts one,
  `{port}` replaced by a free loopback port. The driver starts it as its own child (so it runs as the episode does:
  same user, HOME as its working directory, the driver's minimal environment less the proxy variables, in the
  episode's process group), waits for its /health route (bounded; its output's tail in the error if it exits or
  never answers) and stops it when the episode ends.
- `data`: the job's data, an object (or null): the keyword arguments of the environment's reset.
- `kwargs`: `max_turns` (default 8, 1..256), `system_prompt` (a string; "" for none), `sampling` (an object merged
  into each chat completion request, e.g. {"temperature": 0.0, "max_tokens": 64}).

The turn protocol (the one verifiers' own OpenEnv taskset uses, verifiers/v1/tasksets/openenv/taskset.py): the
observation and the action's JSON schema (the server's /schema route) are one JSON user message; the model's reply
(one chat completion per turn, the conversation growing) is the action: a JSON object, a fenced JSON object, or, for
an action with exactly one required field, that field's value. A reply that is no action (empty, or neither of
those) or an action the server's validation refuses ends the episode. Until the environment says done or after
max_turns steps, the step rewards are summed; the sum is the last stdout line. Exit 1 with the error on stderr when
the episode failed (the server could not start, died, or answered an error).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

CHECK_FAILED = 3
EPISODE_FAILED = 1
INVALID_JOB = 4  # the job's own data or workflow_kwargs are wrong: the worker dead-letters it at once
MAX_TURNS_DEFAULT = 8
MAX_TURNS_LIMIT = 256
SERVER_START_S = 120.0  # a server that answers no /health by then never will (the episode timeout bounds it too)
SERVER_STOP_S = 5.0  # SIGTERM, then this long before SIGKILL
HEALTH_POLL_S = 0.1
HTTP_TIMEOUT_S = 10.0
OUTPUT_TAIL_BYTES = 2048
KWARGS = ("max_turns", "system_prompt", "sampling")
# What a job's sampling may set in each turn's chat request (extra_body: anything else would override the request the
# driver builds, its messages included).
SAMPLING_KEYS = frozenset(
    {
        "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "seed", "stop",
    }
)  # fmt: skip
PROXY_VARIABLES = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY")
DEFAULT_SYSTEM_PROMPT = (
    "You act in an environment. Each user message is a JSON object: `observation`, what the environment shows you "
    "now, and `action_schema`, the JSON schema of an action. Reply with one action as a JSON object and nothing else."
)


class EpisodeError(Exception):
    """The episode failed: the message says why (printed on stderr, exit 1)."""


class InvalidJob(Exception):
    """The job's data or workflow_kwargs are wrong: one line on stderr, exit 4 (no retry can help)."""


def check() -> int:
    try:
        from openenv import GenericEnvClient  # noqa: F401  (openai comes with it: a dependency of openenv)
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        message = f"openenv is not importable by {sys.executable}: {type(exc).__name__}: {exc}"
        print(" ".join(message.split()), file=sys.stderr)  # one line
        return CHECK_FAILED
    return 0


# -- the payload -------------------------------------------------------------------------------------------------


def read_payload(text: str) -> dict[str, Any]:
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EpisodeError(f"the payload on stdin is no JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise EpisodeError("the payload on stdin must be a JSON object")
    server = payload.get("server")
    if not isinstance(server, str) or not server.strip():
        raise EpisodeError(f"OpenEnv server {payload.get('name')!r}: the payload names no server (a URL or a command)")
    data = payload.get("data")
    if data is None:
        payload["data"] = {}
    elif not isinstance(data, dict):
        raise InvalidJob(
            f"the job's data must be a JSON object (the keyword arguments of the environment's reset), "
            f"not {type(data).__name__}"
        )
    kwargs = payload.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidJob("workflow_kwargs must be a JSON object")
    unknown = sorted(set(kwargs) - set(KWARGS))
    if unknown:
        raise InvalidJob(f"an OpenEnv job's workflow_kwargs may hold only {', '.join(KWARGS)}; it has {unknown}")
    max_turns = kwargs.get("max_turns", MAX_TURNS_DEFAULT)
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or not 1 <= max_turns <= MAX_TURNS_LIMIT:
        raise InvalidJob(f"max_turns must be a whole number from 1 to {MAX_TURNS_LIMIT}, not {max_turns!r}")
    system_prompt = kwargs.get("system_prompt", DEFAULT_SYSTEM_PROMPT)
    if not isinstance(system_prompt, str):
        raise InvalidJob("system_prompt must be a string")
    sampling = kwargs.get("sampling") or {}
    if not isinstance(sampling, dict) or set(sampling) - SAMPLING_KEYS:
        raise InvalidJob(
            f"sampling must be an object of sampling parameters ({', '.join(sorted(SAMPLING_KEYS))}): the rest of "
            "the request (messages, tools, model, stream...) is the driver's"
        )
    payload["kwargs"] = {"max_turns": max_turns, "system_prompt": system_prompt, "sampling": sampling}
    return payload


# -- the server --------------------------------------------------------------------------------------------------


def is_url(server: str) -> bool:
    return server.startswith(("http://", "https://"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """A server the driver started: its output's tail kept (a reader thread; a chatty server never fills a pipe)."""

    def __init__(self, command: str) -> None:
        self.port = free_port()
        try:
            self.argv = [arg.replace("{port}", str(self.port)) for arg in shlex.split(command)]
        except ValueError as exc:
            raise EpisodeError(f"the server command {command!r} cannot be split shell-style: {exc}") from None
        if not self.argv:
            raise EpisodeError("the server command is empty")
        self.url = f"http://127.0.0.1:{self.port}"
        self._tail: collections.deque[bytes] = collections.deque()
        self._tail_bytes = 0
        self._lock = threading.Lock()
        # The model's proxy is the policy's alone: a server never holds the episode's key (what it would generate
        # through it would be recorded as the policy's turns).
        env = {k: v for k, v in os.environ.items() if k not in PROXY_VARIABLES}
        started = time.monotonic()
        try:
            # In the driver's process group (the episode's: killed whole when it ends), its working directory HOME.
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
            )
        except OSError as exc:
            raise EpisodeError(f"cannot start the OpenEnv server {shlex.join(self.argv)!r}: {exc}") from None
        self.started = started
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        for chunk in iter(lambda: os.read(fd, 4096), b""):  # what has arrived, up to 4 KiB: never waits for more
            with self._lock:
                self._tail.append(chunk)
                self._tail_bytes += len(chunk)
                while self._tail_bytes - len(self._tail[0]) >= OUTPUT_TAIL_BYTES:
                    self._tail_bytes -= len(self._tail.popleft())

    def output_tail(self) -> str:
        self._reader.join(timeout=SERVER_STOP_S)  # what it wrote before it exited
        with self._lock:
            text = b"".join(self._tail)[-OUTPUT_TAIL_BYTES:].decode(errors="replace").strip()
        return f"its output (the last {OUTPUT_TAIL_BYTES} bytes):\n{text}" if text else "it wrote nothing"

    def wait_healthy(self) -> None:
        started = self.started
        deadline = started + SERVER_START_S
        while True:
            if healthy(self.url):
                print(f"the OpenEnv server answered {self.url}/health after {time.monotonic() - started:.2f}s")
                return
            try:  # waits on the process itself: a server that dies is seen at once
                code = self.proc.wait(timeout=HEALTH_POLL_S)
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise EpisodeError(
                        f"the OpenEnv server {shlex.join(self.argv)!r} did not answer {self.url}/health within "
                        f"{SERVER_START_S:g}s; {self.output_tail()}"
                    ) from None
                continue
            raise EpisodeError(
                f"the OpenEnv server {shlex.join(self.argv)!r} exited with code {code} before it answered "
                f"{self.url}/health; {self.output_tail()}"
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=SERVER_STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=HTTP_TIMEOUT_S) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def action_schema(url: str) -> dict[str, Any]:
    """The action's JSON schema from the server's /schema route (openenv/core/env_server/http_server.py,
    get_schemas: {"action", "observation", "reset_observation", "state"})."""
    try:
        with urllib.request.urlopen(f"{url}/schema", timeout=HTTP_TIMEOUT_S) as response:
            schema = json.loads(response.read())["action"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EpisodeError(f"the OpenEnv server at {url} gave no action schema on /schema: {exc}") from None
    if not isinstance(schema, dict):
        raise EpisodeError(f"the OpenEnv server at {url} gave an action schema that is no object")
    return schema


# -- the turns ---------------------------------------------------------------------------------------------------


class NoAction(Exception):
    """The model's reply is no action for this schema."""


def parse_action(reply: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The reply as an action: a JSON object (fenced or not), or the value of the schema's one required field."""
    text = reply.strip()
    if not text:
        raise NoAction("the reply is empty")
    if text.startswith("```") and text.endswith("```"):
        text = "\n".join(text.splitlines()[1:-1]).strip()
    try:
        value: Any = json.loads(text)
    except json.JSONDecodeError:
        value = text
    if isinstance(value, dict):
        return value
    required = schema.get("required") or []
    if len(required) != 1:
        raise NoAction(f"the reply is no JSON object and the action has {len(required)} required fields, not one")
    field = required[0]
    if (schema.get("properties") or {}).get(field, {}).get("type") == "string":
        value = reply.strip()  # a text field takes the reply as written ("42" stays text, not a number)
    return {field: value}


def user_turn(observation: Any, schema: dict[str, Any]) -> dict[str, str]:
    content = json.dumps({"observation": observation, "action_schema": schema}, ensure_ascii=False)
    return {"role": "user", "content": content}


def is_refused(exc: Exception) -> bool:
    """The server refused the action as invalid: EnvClient raises RuntimeError("Server error: ... (code:
    VALIDATION_ERROR)") (openenv/core/env_client.py, _send_and_receive; the code from http_server.py's /ws)."""
    return isinstance(exc, RuntimeError) and "(code: VALIDATION_ERROR)" in str(exc)


def import_client() -> None:
    import openai  # noqa: F401
    import openenv.core  # noqa: F401


async def run_turns(url: str, payload: dict[str, Any]) -> float:
    from openai import AsyncOpenAI
    from openenv import GenericEnvClient

    kwargs = payload["kwargs"]
    schema = action_schema(url.replace("ws://", "http://", 1).replace("wss://", "https://", 1))
    model = AsyncOpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY: the proxy and the episode's key; the SDK's retries
    try:
        served = (await model.models.list()).data[0].id
        total = 0.0
        async with GenericEnvClient(base_url=url) as env:
            result = await env.reset(**payload["data"])
            system = kwargs["system_prompt"]
            messages: list[Any] = [{"role": "system", "content": system}] if system else []
            for turn in range(kwargs["max_turns"]):
                if result.done:
                    break
                messages.append(user_turn(result.observation, schema))
                completion = await model.chat.completions.create(
                    model=served, messages=messages, extra_body=kwargs["sampling"]
                )
                reply = completion.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": reply})
                try:
                    action = parse_action(reply, schema)
                    result = await env.step(action)
                except NoAction as exc:
                    print(f"turn {turn + 1}: {exc}: the episode ends", file=sys.stderr)
                    break
                except RuntimeError as exc:
                    if not is_refused(exc):
                        raise
                    print(f"turn {turn + 1}: the server refused the action: {exc}: the episode ends", file=sys.stderr)
                    break
                total += float(result.reward or 0.0)
        return total
    finally:
        await model.close()


def episode(payload: dict[str, Any]) -> float:
    server = payload["server"].strip()
    if is_url(server):
        return asyncio.run(run_turns(server.rstrip("/"), payload))
    process = ServerProcess(server)
    try:
        # The server starts while this process imports openenv (seconds each: both import gradio), on another core.
        import_client()
        process.wait_healthy()
        try:
            return asyncio.run(run_turns(process.url, payload))
        except EpisodeError:
            raise
        except Exception as exc:
            if process.proc.poll() is not None:
                raise EpisodeError(
                    f"the OpenEnv server exited with code {process.proc.returncode} during the episode "
                    f"({type(exc).__name__}: {exc}); {process.output_tail()}"
                ) from None
            raise
    finally:
        process.stop()


def main(argv: list[str]) -> int:
    if argv[1:2] == ["--check"]:
        return check()
    if len(argv) > 1:
        print(f"usage: {argv[0]} [--check [NAME]] (the payload on stdin)", file=sys.stderr)
        return 2
    name = "environment"
    try:
        payload = read_payload(sys.stdin.read())
        name = f"environment {payload.get('name')!r}"
        reward = episode(payload)
    except InvalidJob as exc:
        print(" ".join(f"OpenEnv {name}: {exc}".split()), file=sys.stderr)  # one line: the worker quotes the last
        return INVALID_JOB
    except EpisodeError as exc:
        print(f"OpenEnv {name}: {exc}", file=sys.stderr)
        return EPISODE_FAILED
    except Exception as exc:  # the environment's client or the model failed: the worker retries, then dead-letters
        print(f"OpenEnv {name}: the episode failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EPISODE_FAILED
    print(json.dumps(reward))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
