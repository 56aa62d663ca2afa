"""The messages every rollq process exchanges. Adding a field with a default is compatible when an older reader may
ignore it; anything else bumps SCHEMA_VERSION."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from rollq.protocol.arrays import Float32Array, Int32Array, UInt8Array
from rollq.protocol.keys import DEFAULT_CLASS, partition_share, validate_class_name

SCHEMA_VERSION = 4  # the newest message schema this code reads
# A message's `schema` absent on the wire (omit_defaults) means 1, so an older reader's default and ours agree. A job
# that uses a field an older worker would ignore to the job's harm (JOB_SCHEMA_2_FIELDS: it would run without its
# data, or with a wider allowlist) says schema 2, and such a worker refuses it (SchemaTooNew) instead; a job naming a
# LoRA adapter (`lora`) says 3: a worker before it would generate with the base weights. A trajectory with images
# (`Sequence.vision`) says 4: a trainer before it would train the text alone.
BASE_SCHEMA = 1
TRACEPARENT_MAX = 128  # a W3C traceparent is 55 characters; a longer one is refused, not carried

# "cancelled": the sample was cancelled before it started (`Job.cancellable` jobs; it never ran). Consumers that
# know only the first three treat it as they treat "error": not trainable.
TrajectoryStatus = Literal["ok", "rejected", "error", "cancelled"]


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
    # Passed over workflow_kwargs only to a workflow class whose constructor names them (the trainer's evaluation:
    # `temperature` for the built-in loops, left out for an agent that takes none). A worker before this field runs
    # the job without them, as the training jobs ran.
    optional_kwargs: dict[str, Any] | None = None
    agent: AgentOptions | None = None  # only for agent workflows; None = defaults
    reply_to: str = ""  # results stream key; "" = the run's shared results stream
    attempt: int = 0  # failed runs before this one (the workflow raised)
    submitted_at: float = 0.0
    is_eval: bool = False  # an evaluation sample (workflows read it as workflow_context.get().is_eval)
    # Has a control record (RunKeys.job_control): the worker marks each sample started there before running it, and
    # skips (acks, publishes a "cancelled" result for) a sample whose job was cancelled first. The ingress sets it.
    cancellable: bool = False
    job_class: str = DEFAULT_CLASS  # the class whose stream holds it (JobClass); "train" when absent
    # The engine request priority of this job's generation (larger first), within its class's; None: the class's.
    # The trainer gives older groups a higher one (`priority_by_age`) so they finish first.
    priority: int | None = None
    # The SHA-256 (hex) of the job's data in the run's blob store (RunKeys.blob, on the job's partition), when the
    # data travels by reference (`data` is then None): the n samples of a prompt, and every job with the same data,
    # share one stored copy. Producers use it for data of BLOB_MIN_BYTES and more (protocol.blobs).
    data_ref: str = ""
    # The ingress tenant that submitted it: its samples count against the tenant's queued-sample quota
    # (RunKeys.tenant_queued) until a worker starts them.
    tenant: str = ""
    # Import patterns this job may use besides none (a tenant's `tenant_workflows`): the worker allows only what its
    # own allowlist AND these allow, for everything the episode resolves (workflow, kwargs' reward_fn and tools,
    # agent_name). None: the worker's allowlist alone.
    allow: list[str] | None = None
    # The LoRA adapter its generation names: the trainer's adapter of the policy version the group was admitted
    # under (`<run>-v<N>`, loaded on the engines before that admission); "" = the engines' own weights.
    lora: str = ""
    # W3C traceparent of the span that submitted it (rollq.tracing): its samples' spans join that trace. Tracing
    # only: a reader that knows no traces ignores it.
    traceparent: Annotated[str, msgspec.Meta(max_length=TRACEPARENT_MAX)] = ""
    # The worker adds each sequence's decoded prompt and completion (Sequence.text) to the trajectory. Off by
    # default: text costs bytes. A worker before it ignores it (no text; nothing else changes).
    text: bool = False
    schema: int = BASE_SCHEMA

    def __post_init__(self) -> None:
        if self.schema < 2 and (self.data_ref or self.tenant or self.allow is not None):
            self.schema = 2
        if self.schema < 3 and self.lora:
            self.schema = 3


class JobClass(msgspec.Struct, kw_only=True, frozen=True):
    """A class of jobs sharing the engines with the others. Stored per run as JSON in the `RunKeys.classes` hash
    (name -> this), so every service and language sees the same definitions.

    Workers serve a higher `priority` first (strict priority between levels); classes of one level share the
    workers by `weight` (deficit round robin: with both backlogged, weights 3:1 get 75 % : 25 % of the starts).
    `max_inflight` bounds the samples admitted to the class and not yet finished (0 = no bound). Its engine
    requests carry `priority`."""

    name: str
    priority: int = 0
    weight: float = 1.0
    max_inflight: int = 0

    def __post_init__(self) -> None:
        validate_class_name(self.name)
        if not self.weight > 0:
            raise ValueError(f"job class {self.name!r}: weight must be > 0, got {self.weight}")
        if self.max_inflight < 0:
            raise ValueError(f"job class {self.name!r}: max_inflight must be >= 0, got {self.max_inflight}")


DEFAULT_JOB_CLASS = JobClass(name=DEFAULT_CLASS)


def class_bound(classes: Mapping[str, JobClass], name: str, partitions: int) -> int:
    """The SUBMIT / INGRESS_SUBMIT argument for class `name`: its `max_inflight` share on one of `partitions`
    (0 = no bound), or -1 when the run has no such class."""
    known = classes.get(name)
    return -1 if known is None else partition_share(known.max_inflight, partitions)


def job_classes(stored: Mapping[Any, Any]) -> dict[str, JobClass]:
    """The run's classes from the `RunKeys.classes` hash (HGETALL's reply), `train` included even when absent.
    An entry that does not decode is left out (and its stream unread) rather than stopping every worker."""
    out = {DEFAULT_CLASS: DEFAULT_JOB_CLASS}
    for name, raw in stored.items():
        try:
            cls = msgspec.json.decode(raw, type=JobClass)
        except (msgspec.DecodeError, ValueError):
            continue
        key = name.decode() if isinstance(name, bytes) else str(name)
        if cls.name == key:
            out[key] = cls
    return out


class ErrorRecord(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    type: str
    message: str
    traceback: str = ""
    worker_id: str = ""
    attempt: int = 0
    at: float = 0.0


class VisionInputs(msgspec.Struct, kw_only=True, gc=False):
    """What a vision-language model's forward takes beside one sequence's input_ids (Qwen2-VL's names, as AReaL's
    `multi_modal_input` holds them): the images' patches and grids, and which tokens are image tokens."""

    pixel_values: Float32Array  # the processor's pixel_values, row-major, of shape pixel_shape
    pixel_shape: list[int]  # e.g. [patches, 1176] for Qwen2-VL
    image_grid_thw: Int32Array  # [images, 3] row-major: each image's (temporal, height, width) patch grid
    mm_token_type_ids: UInt8Array  # per token of the sequence: 0 text, 1 image, 2 video (the processor's)

    def __post_init__(self) -> None:
        if math.prod(self.pixel_shape) != len(self.pixel_values):
            raise ValueError(f"pixel_values has {len(self.pixel_values)} values for shape {self.pixel_shape}")
        if len(self.image_grid_thw) % 3:
            raise ValueError(f"image_grid_thw has {len(self.image_grid_thw)} values: 3 per image")


class VisionRef(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A sequence's VisionInputs (msgpack), inline below the worker's `vision_inline_bytes`, else in the run's blob
    store under its digest (RunKeys.blob), stored before the trajectory is published and expiring with the run's
    retention (`blob_ttl_s`)."""

    digest: str  # SHA-256 (hex) of the encoded VisionInputs
    size: int  # its bytes
    inline: bytes | None = None  # the encoded VisionInputs, when carried here


class SequenceText(msgspec.Struct, kw_only=True, gc=False):
    """A sequence as text, decoded by the worker from its input_ids with the job's tokenizer (its workflow's
    `tokenizer`, else the worker's), special tokens kept: `prompt` up to the first token the model generated,
    `completion` the rest (tool and user turns between the model's tokens included). For reading only: training
    uses the ids."""

    prompt: str
    completion: str


class Sequence(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One token sequence. All four arrays have the same length. (Defaults are omitted on the wire: a missing
    `reward` is 0.0.)"""

    input_ids: Int32Array
    loss_mask: UInt8Array
    logprobs: Float32Array
    versions: Int32Array  # policy version that produced each token; -1 for tokens the model did not generate
    reward: float = 0.0
    # The images the model saw in this sequence (a vision-language model's), by reference or inline; the trainer
    # needs them to recompute the logprobs. None: text only.
    vision: VisionRef | None = None
    text: SequenceText | None = None  # only for a job that asked for it (Job.text)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries but input_ids has {n}")

    def completion_start(self) -> int:
        """The index of the first token the model generated (loss_mask 1); the length when there is none."""
        for i, generated in enumerate(self.loss_mask):
            if generated:
                return i
        return len(self.input_ids)


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
    # W3C traceparent of the worker's attempt span: the trainer's train / drop span of the sample is its child.
    traceparent: Annotated[str, msgspec.Meta(max_length=TRACEPARENT_MAX)] = ""
    schema: int = BASE_SCHEMA

    def __post_init__(self) -> None:
        if self.schema < 4 and any(s.vision is not None for s in self.sequences):
            self.schema = 4  # a trainer that knows no images must not train the text alone


class DeadLetter(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A job that will not be retried, with the reason. `raw` holds the payload when it could not be decoded (its
    first 4 KiB when it was refused as too large: JobTooLarge)."""

    entry_id: str
    error: ErrorRecord
    job: Job | None = None
    raw: bytes | None = None
    deliveries: int = 0
