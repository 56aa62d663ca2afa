"""rollq's wire contract: messages, key names, codec and atomic scripts. No I/O."""

from rollq.protocol.arrays import Float32Array, Int32Array, UInt8Array
from rollq.protocol.codec import Codec, CodecError
from rollq.protocol.keys import DEFAULT_CLASS, DEFAULT_RESULTS_GROUP, WORKER_GROUP, RunKeys
from rollq.protocol.messages import (
    SCHEMA_VERSION,
    AgentOptions,
    DeadLetter,
    ErrorRecord,
    Job,
    JobClass,
    Sequence,
    SequenceText,
    Trajectory,
    job_classes,
)

__all__ = [
    "AgentOptions",
    "Codec",
    "DEFAULT_CLASS",
    "CodecError",
    "DEFAULT_RESULTS_GROUP",
    "DeadLetter",
    "ErrorRecord",
    "Float32Array",
    "Int32Array",
    "Job",
    "JobClass",
    "RunKeys",
    "SCHEMA_VERSION",
    "Sequence",
    "SequenceText",
    "Trajectory",
    "UInt8Array",
    "WORKER_GROUP",
    "job_classes",
]
