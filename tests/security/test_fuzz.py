"""Strict decoding: random, truncated and hostile input to every decoder and request parser raises only the
documented error types (never an unexpected exception that would crash a process or answer 500)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rollq.producer.ingress.models import JobBatch, JobSpec
from rollq.protocol import Codec
from rollq.protocol.codec import CodecError
from rollq.protocol.messages import Job
from rollq.workers.config import WorkerConfig
from rollq.workers.proxy import anthropic, chat, responses
from rollq.workers.worker import Worker, _Fatal, salvage_job

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

codec = Codec()
VALID_JOB = codec.encode(Job(job_id="j-1", workflow="tests.workflows:Echo", data={"i": 1}, n=2, reply_to="r"))
VALID_JSON_JOB = codec.encode_json(Job(job_id="j-2", workflow="w:W", data=[1, 2], n=1))


# JSON-like values (what a request body or a decoded stream entry can hold), with hostile numbers and sizes.
def values(ints: st.SearchStrategy[int]) -> st.SearchStrategy:
    return st.recursive(
        st.none() | st.booleans() | ints | st.floats() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
        max_leaves=25,
    )


json_values = values(st.integers(min_value=-(2**70), max_value=2**70))
packable_values = values(st.integers(min_value=-(2**63), max_value=2**64 - 1))
KEYS = ["job_id", "workflow", "data", "n", "sample_index", "reply_to", "schema", "attempt", "messages", "input",
        "max_tokens", "max_output_tokens", "temperature", "top_p", "top_k", "stop", "stream", "stream_options", "tools",
        "tool_choice", "role", "content", "system", "previous_response_id", "text", "instructions", "jobs", "priority",
        "workflow_kwargs", "job_class", "n", "reasoning", "include", "logprobs", "top_logprobs", "seed"]  # fmt: skip
bodies = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=8)
hostile_bytes = (
    st.binary(max_size=300)
    | st.integers(0, len(VALID_JOB)).map(lambda i: VALID_JOB[:i])
    | st.integers(0, len(VALID_JSON_JOB)).map(lambda i: VALID_JSON_JOB[:i])
    | packable_values.map(msgspec.msgpack.encode)
    | st.dictionaries(st.sampled_from(KEYS), packable_values, max_size=8).map(msgspec.msgpack.encode)
    | bodies.map(msgspec.json.encode)
    | st.tuples(st.integers(0, len(VALID_JOB) - 1), st.integers(0, 255)).map(
        lambda t: VALID_JOB[: t[0]] + bytes([t[1]]) + VALID_JOB[t[0] + 1 :]
    )
)
HOSTILE = [
    b"\xdd\xff\xff\xff\xff",  # array of 4 billion entries, no data
    b"\xdf\xff\xff\xff\xff",  # map of 4 billion entries
    b"\xdb\xff\xff\xff\xff",  # str of 4 GiB
    b"\xc9\xff\xff\xff\xff\x01",  # ext 32 of 4 GiB (token arrays are ext 1..3)
    b"\x81\xa1x" * 2000 + b"\xc0",  # deep nesting
    b"[" * 10000,
    b"",
]


def hostile(f):
    for case in HOSTILE:
        f = example(case)(f)
    return f


@FUZZ
@given(hostile_bytes)
@hostile
def test_codec_decoders_raise_only_codec_error(payload: bytes) -> None:
    for decode in (codec.decode_job, codec.decode_trajectory, codec.decode_dead_letter):
        try:
            decode(payload)
        except CodecError:
            pass
    try:
        codec.decode_json(payload, Job)
    except CodecError:
        pass


@pytest.fixture(scope="module")
def worker() -> Worker:
    return Worker(WorkerConfig(redis_url="redis://127.0.0.1:1/0", run="fuzz", allow=["tests"]))


def test_stream_entry_decoder_raises_only_fatal(worker: Worker) -> None:
    @FUZZ
    @given(hostile_bytes | st.none())
    @hostile
    def check(payload: bytes | None) -> None:
        try:
            job = worker._decode("1-0", payload, {b"x": b"y"}, worker.keys)
        except _Fatal:
            assert payload is None or salvage_job(payload) is None or isinstance(salvage_job(payload), Job)
            return
        assert isinstance(job, Job)

    check()


@FUZZ
@given(bodies)
@example({"messages": [{"role": "assistant", "content": "", "tool_calls": [
    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 100000}}]}]})  # fmt: skip
def test_proxy_request_parsers_raise_only_bad_request(body: dict) -> None:
    for parse in (
        lambda b: chat.normalize_messages(b.get("messages")),
        lambda b: chat.normalize_tools(b.get("tools")),
        lambda b: chat.generation_params(b, 16, max_tokens_keys=("max_completion_tokens", "max_tokens")),
        lambda b: responses.parse_request(b, 16),
        lambda b: anthropic.normalize_messages(b),
        lambda b: anthropic.normalize_tools(b.get("tools")),
        lambda b: anthropic.generation_params(b),
    ):
        try:
            parse(body)
        except chat.BadRequest:
            pass


@FUZZ
@given(hostile_bytes)
@hostile
def test_ingress_request_models_raise_only_msgspec_errors(payload: bytes) -> None:
    try:
        obj = msgspec.json.decode(payload)
    except (msgspec.DecodeError, RecursionError):  # what the ingress and the proxy catch: 400
        return
    for model in (JobSpec, JobBatch):
        try:
            msgspec.convert(obj, model)
        except msgspec.ValidationError:
            pass
