"""The messages every rollq process exchanges. Adding a field with a default is compatible; anything else bumps
SCHEMA_VERSION."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from rollq.protocol.arrays import Float32Array, Int32Array, UInt8Array

SCHEMA_VERSION = 1

TrajectoryStatus = Literal["ok", "rejected", "error"]


ExportStyle = Literal["individual", "concat"]


class AgentOptions(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """How the worker runs an agent workflow (a class with `async def run(self, data, **extra_kwargs)`). Names and
    defaults as AReaL's `rollout.agent` settings (mode, export_style, turn_discount)."""

    mode: Literal["inline", "subproc"] = "inline"  # subproc: a process pool, OPENAI_BASE_URL/OPENAI_API_KEY set
    export_style: ExportStyle = "individual"  # a sequence per completion | per conversation branch
    export: ExportStyle | None = None  # rollq's earlier name of export_style (accepted; folded into export_style)
    # A completion's reward is its own (unset = 0) plus this times its child's (the mean over several children).
    turn_discount: float = 1.0
    timeout_seconds: float = 600.0  # an episode running longer fails (subproc: its process is killed)
    max_tokens: int = 0  # default max_tokens for requests that give none; 0 = the proxy's default

    def __post_init__(self) -> None:
        if self.export is not None:
            if self.export_style not in ("individual", self.export):
                raise ValueError(f"export={self.export!r} contradicts export_style={self.export_style!r}")
            msgspec.structs.force_setattr(self, "export_style", self.export)
            msgspec.structs.force_setattr(self, "export", None)
        if not 0.0 <= self.turn_discount <= 1.0:
            raise ValueError(f"turn_discount must be in [0, 1], got {self.turn_discount}")
        if not self.timeout_seconds > 0:
            raise ValueError("timeout_seconds must be > 0")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")


class Job(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One sample of one prompt. A prompt with n samples is n jobs sharing job_id (sample_index 0..n-1)."""

    job_id: str
    workflow: str
    data: Any = None
    sample_index: int = 0
    n: int = 1
    workflow_kwargs: dict[str, Any] | None = None
    agent: AgentOptions | None = None  # only for agent workflows; None = defaults
    reply_to: str = ""  # results stream key; "" = the run's shared results stream
    attempt: int = 0  # failed runs before this one (the workflow raised)
    submitted_at: float = 0.0
    is_eval: bool = False  # an evaluation sample (workflows read it as workflow_context.get().is_eval)
    schema: int = SCHEMA_VERSION


class ErrorRecord(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    type: str
    message: str
    traceback: str = ""
    worker_id: str = ""
    attempt: int = 0
    at: float = 0.0


class Sequence(msgspec.Struct, kw_only=True, gc=False):
    """One token sequence. All four arrays have the same length."""

    input_ids: Int32Array
    loss_mask: UInt8Array
    logprobs: Float32Array
    versions: Int32Array  # policy version that produced each token; -1 for tokens the model did not generate
    reward: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries but input_ids has {n}")


class Trajectory(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """What a worker publishes for one job: the sequences of one sample, or why there are none."""

    job_id: str
    sample_index: int
    n: int
    status: TrajectoryStatus
    sequences: list[Sequence] = []
    error: ErrorRecord | None = None
    worker_id: str = ""
    workflow: str = ""
    attempt: int = 0
    submitted_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    schema: int = SCHEMA_VERSION


class DeadLetter(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A job that will not be retried, with the reason. `raw` holds the payload when it could not be decoded."""

    entry_id: str
    error: ErrorRecord
    job: Job | None = None
    raw: bytes | None = None
    deliveries: int = 0
