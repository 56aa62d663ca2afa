"""rollq's driver for verifiers environments: runs in the environment's own interpreter (the worker's
`verifiers_python`), standard library and verifiers only. Never imports rollq.

    python verifiers_driver.py --check ENV_ID   exit 0 when verifiers can load ENV_ID, else one line on stderr, exit 3
    python verifiers_driver.py < payload.json   one episode, its reward the last stdout line

The payload (rollq.workers.environments.agent): {"name": ENV_ID, "kwargs": {"env_args": {...}, "sampling": {...}},
"data": {"idx": N}}. The episode is the one `vf-eval ENV_ID` runs for the taskset's task N, through verifiers' own
machinery: the environment loaded by id with `env_args` as the taskset's config (verifiers/v1/utils/loaders.py
resolve_env_config, load_environment), task N picked by its `idx` (its position in the taskset's `load()`, the
number vf-eval gives it: verifiers/v1/taskset.py Taskset.__iter__, include), run with `Env.run_slot` inside
`Env.serving()` as vf-eval's runner does (verifiers/v1/cli/eval/runner.py _in_process), its agents in verifiers'
`subprocess` runtime (`vf-eval --env.agent.runtime.type subprocess`), its model calls sent by
verifiers' EvalClient to OPENAI_BASE_URL with the key in OPENAI_API_KEY (the worker's recording proxy and the
episode's session key) and the job's `sampling`. The reward printed is the trace's own `Trace.reward` (the weighted
sum of its @reward scores, verifiers/v1/trace.py), what vf-eval reports for it. An episode verifiers marks failed
(a raising reward, a harness error) exits 1 with its errors on stderr.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

CHECK_FAILED = 3
EPISODE_FAILED = 1
INVALID_JOB = 4  # the job's own values are wrong: the worker dead-letters it at once (no retry can help)
DEFAULT_MODEL = "rollq"  # when the endpoint lists none
LOCAL_RUNTIME = {"type": "subprocess"}  # verifiers/v1/runtimes/subprocess.py SubprocessConfig


class EpisodeError(Exception):
    """The episode cannot run, or verifiers marked it failed: exit 1 with this message."""


class InvalidJob(Exception):
    """The job's data or workflow_kwargs are wrong for this environment: exit 4 with this one-line message."""


# What a job's env_args may set: the environment's own fields whose values are numbers, booleans or one of fixed
# choices. verifiers' own taskset fields (`task`, `system_prompt`, `id`: files read as prompts, reward functions and
# judges named by import path or file, judges' URLs and keys; verifiers/v1/configs/taskset.py, configs/task.py) and
# any field taking a string, a path or a structure could make an episode read a file, run code or call a server the
# operator never chose: those stay at the environment's defaults.
SCALARS = (bool, int, float)


def settable(annotation: object) -> bool:
    """Whether a job may set a config field of this type: bool / int / float, a Literal of such or of strings, or
    an Optional of one of those."""
    import types
    import typing

    if annotation in SCALARS:
        return True
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return all(isinstance(a, (*SCALARS, str)) for a in args)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return bool(rest) and all(settable(a) for a in rest)
    return False


def checked_env_args(env_id: str, env_args: object) -> dict:
    """The job's env_args, refused (InvalidJob) unless each names a settable field of the environment's own config."""
    from verifiers.v1.configs.taskset import TasksetConfig
    from verifiers.v1.utils.loaders import taskset_config_type

    if not isinstance(env_args, dict):
        raise InvalidJob("env_args must be an object of the environment's taskset config fields")
    config = taskset_config_type(env_id)
    fields = config.model_fields
    for key in env_args:
        if key in TasksetConfig.model_fields:
            raise InvalidJob(
                f"env_args may not set {key!r}: verifiers' own taskset fields (files, reward functions, judges) stay "
                "at the environment's defaults"
            )
        if key not in fields:
            raise InvalidJob(
                f"env_args: environment {env_id!r} has no config field {key!r} (it has: "
                f"{', '.join(sorted(set(fields) - set(TasksetConfig.model_fields))) or 'none'})"
            )
        if not settable(fields[key].annotation):
            raise InvalidJob(
                f"env_args may not set {key!r} ({fields[key].annotation}): a job sets only numbers, booleans and "
                "fixed choices (a string, path or structure could name a file, a function or a server)"
            )
    return dict(env_args)


def check(env_id: str) -> int:
    try:
        from verifiers.v1.utils.loaders import taskset_class
    except Exception as exc:  # not installed, or broken: either way this interpreter cannot run it
        return _refuse(f"verifiers is not importable by {sys.executable}: {type(exc).__name__}: {exc}")
    try:
        taskset_class(env_id)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        # What verifiers' loader raises for a package that is not there or exports no Taskset (verifiers/v1/utils/
        # loaders.py _import_plugin, _plugin_class): the worker keeps this verdict for its life. Anything else (no
        # memory, a full disk) is a crash it asks about again.
        return _refuse(f"verifiers cannot load environment {env_id!r}: {type(exc).__name__}: {exc}")
    return 0


def _refuse(message: str) -> int:
    print(" ".join(message.split()), file=sys.stderr)  # one line
    return CHECK_FAILED


def served_model(base_url: str, api_key: str) -> str:
    """The model the endpoint serves (its /models list), which verifiers records on the trace; any name works."""
    request = urllib.request.Request(f"{base_url.rstrip('/')}/models", headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            models = json.load(reply).get("data") or []
    except (OSError, ValueError):
        return DEFAULT_MODEL
    return str(models[0].get("id") or DEFAULT_MODEL) if models and isinstance(models[0], dict) else DEFAULT_MODEL


def task_index(data: object) -> int:
    idx = data.get("idx") if isinstance(data, dict) else None
    if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0:
        raise InvalidJob(
            f'the job\'s data must name a task as {{"idx": N}} (N >= 0, as vf-eval numbers them), got {data!r:.200}'
        )
    return idx


async def episode_reward(payload: dict) -> float:
    import verifiers.v1 as vf
    from pydantic import ValidationError
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.env import RunSlot
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    env_id = payload["name"]
    kwargs = payload.get("kwargs") or {}
    env_args = checked_env_args(env_id, kwargs.get("env_args") or {})
    idx = task_index(payload.get("data"))
    raw = {"taskset": {**env_args, "id": env_id}}
    # Every agent seat in verifiers' `subprocess` runtime: its harness runs here, inside the worker's command-agent
    # boundary (agent_user, its own HOME, no secrets, its process group killed at the end). verifiers' default is
    # Prime's remote sandboxes (verifiers/v1/configs/agent.py AgentConfig.runtime), which need Prime credentials and
    # a tunnel back to this host; partial seat settings merge onto the seat's own (configs/agent.py
    # merge_agent_defaults).
    try:
        seats = agent_config_fields(resolve_env_config(raw))
        config = resolve_env_config({**raw, **{seat: {"runtime": LOCAL_RUNTIME} for seat in seats}})
    except ValidationError as exc:  # a value the environment's config refuses: the job's, not the episode's
        raise InvalidJob(f"env_args: {' '.join(str(exc).split())}") from None
    env = load_environment(config)
    tasks = list(env.taskset.include(idx=[idx]))
    if len(tasks) != 1:
        raise InvalidJob(f"environment {env_id!r} has no task {idx} (its taskset with env_args {env_args})")
    base_url, key_var = os.environ["OPENAI_BASE_URL"], "OPENAI_API_KEY"
    ctx = vf.ModelContext(
        model=served_model(base_url, os.environ[key_var]),
        client=vf.EvalClientConfig(base_url=base_url, api_key_var=key_var),
        sampling=sampling_config(vf, kwargs.get("sampling") or {}),
    )
    async with env.serving():
        episode = await env.run_slot(RunSlot(tasks[0]), ctx)
    if not episode.ok or any(not t.ok for t in episode.traces):
        errors = [*episode.errors, *(e for t in episode.traces for e in getattr(t, "errors", []) or [])]
        said = "; ".join(f"{e.type}: {e.message}" for e in errors) or "no error recorded"
        tracebacks = "\n".join(e.traceback for e in errors if getattr(e, "traceback", None))
        raise EpisodeError(f"verifiers marked the episode of task {idx} failed: {said}\n{tracebacks}".rstrip())
    if len(episode.traces) != 1:
        raise EpisodeError(
            f"the episode of task {idx} has {len(episode.traces)} traces: rollq runs environments whose episode is "
            "one agent's trace (verifiers' SingleAgentEnv, every plain taskset)"
        )
    return float(episode.traces[0].reward)


# The sampling settings a job may give. verifiers passes every other key (extra_body's too) into the request over
# what the harness built (verifiers/v1/types.py SamplingConfig extra='allow'; dialects/chat.py apply_overrides), so a
# job could replace the task's messages or add tools: the environment decides what the model is asked.
SAMPLING_KEYS = frozenset(
    {
        "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "seed", "stop", "reasoning_effort",
    }
)  # fmt: skip


def sampling_config(vf: object, sampling: object) -> object:
    from pydantic import ValidationError

    if not isinstance(sampling, dict):
        raise InvalidJob("sampling must be an object of verifiers' sampling settings")
    other = sorted(set(sampling) - SAMPLING_KEYS)
    if other:
        raise InvalidJob(f"sampling may not set {', '.join(other)} (it takes {', '.join(sorted(SAMPLING_KEYS))})")
    try:
        return vf.SamplingConfig(**sampling)  # type: ignore[attr-defined]
    except (ValidationError, TypeError) as exc:
        raise InvalidJob(f"sampling: {' '.join(str(exc).split())}") from None


def run(stdin: str) -> int:
    import asyncio

    try:
        payload = json.loads(stdin)
        reward = asyncio.run(episode_reward(payload))
    except InvalidJob as exc:
        print(" ".join(str(exc).split()), file=sys.stderr)  # one line: the worker quotes the last
        return INVALID_JOB
    except EpisodeError as exc:
        print(exc, file=sys.stderr)
        return EPISODE_FAILED
    print(json.dumps(reward))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--check":
        return check(argv[1])
    if not argv:
        return run(sys.stdin.read())
    print("usage: verifiers_driver.py --check ENV_ID | verifiers_driver.py < payload.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
