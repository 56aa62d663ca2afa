"""`rollq enqueue` and `rollq status` settings: the `enqueue` / `status` sections, ROLLQ_ENQUEUE_<KEY> /
ROLLQ_STATUS_<KEY>, and the commands' flags."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from rollq.config import RunSettings, setting

AGENTS = "agent workflows (a class with `async def run(self, data, **extra_kwargs)`)"


class EnqueueConfig(RunSettings, kw_only=True):
    """Submit one job per JSONL line, and optionally wait for the trajectories."""

    file: Annotated[
        str,
        setting(
            "JSONL file, one job's data per line ('-' = stdin); a 'job_id' key makes a line idempotent", positional=True
        ),
    ]
    workflow: Annotated[
        str,
        setting("workflow: a built-in loop's name or an import path, e.g. my_module:MyWorkflow", metavar="IMPORT_PATH"),
    ]
    n: Annotated[int, setting("samples per line", metavar="N", ge=1)] = 1
    wait: Annotated[bool, setting("wait for the trajectories and write them as JSON lines")] = False
    output: Annotated[str | None, setting("where --wait writes trajectories (default stdout)", metavar="FILE")] = None
    timeout: Annotated[
        float, setting("give up waiting after S seconds (0 = wait as long as it takes)", metavar="S", ge=0)
    ] = 0.0
    max_inflight: Annotated[
        int, setting("backpressure: samples admitted but not consumed (0 = no bound)", metavar="N", ge=0)
    ] = 0
    reply_ttl: Annotated[
        int,
        setting(
            "--wait: the private reply stream expires S seconds after this command stops renewing it (e.g. killed)",
            metavar="S",
            ge=1,
        ),
    ] = 3600
    kwargs: Annotated[
        dict[str, Any] | None,
        setting("workflow_kwargs: the workflow class's arguments (a JSON or YAML mapping)", metavar="JSON"),
    ] = None
    agent_mode: Annotated[
        Literal["inline", "subproc"],
        setting(
            "inline: in the worker's event loop; subproc: in a process pool, OPENAI_BASE_URL/OPENAI_API_KEY set",
            group=AGENTS,
        ),
    ] = "inline"
    export_style: Annotated[
        Literal["individual", "concat"], setting("a sequence per completion, or per conversation branch", group=AGENTS)
    ] = "individual"
    turn_discount: Annotated[
        float,
        setting(
            "a completion's reward = its own + this x its child's (mean of its children's), as AReaL's",
            ge=0,
            le=1,
            group=AGENTS,
        ),
    ] = 1.0
    text: Annotated[
        bool,
        setting(
            "--wait: each sequence carries its decoded `text` (prompt, completion), decoded by the worker with the "
            "workflow's tokenizer (else the worker's)"
        ),
    ] = False
    is_eval: Annotated[
        bool, setting("evaluation samples (workflows read workflow_context.get().is_eval; AReaL's name)")
    ] = False
    job_class: Annotated[
        str, setting("the jobs' class (`rollq classes`): its stream, priority, share and budget", metavar="NAME")
    ] = "train"
    agent_timeout: Annotated[float, setting("an episode's time limit", metavar="S", gt=0, group=AGENTS)] = 600.0
    max_tokens: Annotated[
        int, setting("default max_tokens of the agent's requests (0 = the proxy's)", metavar="N", ge=0, group=AGENTS)
    ] = 0


class ClassesConfig(RunSettings, kw_only=True):
    """Define the run's job classes (`rollq classes set NAME ...`) or list them (`rollq classes list`)."""

    action: Annotated[
        Literal["list", "set", "delete"],
        setting("list the classes, set (create or change) one, or delete one whose stream is empty", positional=True),
    ] = "list"
    name: Annotated[str, setting("the class (set, delete)", positional=True)] = ""
    priority: Annotated[int, setting("higher is served first (strict priority between levels)", metavar="P")] = 0
    weight: Annotated[
        float, setting("share among the classes of its priority level (deficit round robin)", metavar="W", gt=0)
    ] = 1.0
    max_inflight: Annotated[
        int, setting("admission budget: samples queued or running at most (0 = no bound)", metavar="N", ge=0)
    ] = 0
    json: Annotated[bool, setting("machine-readable output (list)")] = False


class StatusConfig(RunSettings, kw_only=True):
    """Queue lengths, pending work, dead letters, live workers and the trainer's ledger."""

    json: Annotated[
        bool, setting("machine-readable output (one JSON object per line; with --watch, one per refresh)")
    ] = False
    watch: Annotated[
        float, setting("refresh every S seconds as a live view until Ctrl-C (0 = print once)", metavar="S", ge=0)
    ] = 0.0
    run_dir: Annotated[
        str,
        setting(
            "the run directory of a `rollq up` (its up.json): its Redis and run, in place of --redis and --run",
            metavar="DIR",
        ),
    ] = ""


__all__ = ["ClassesConfig", "EnqueueConfig", "StatusConfig"]
