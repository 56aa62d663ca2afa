import msgspec
import pytest

from rollq.protocol import Codec, CodecError, Float32Array, Int32Array, Job, Sequence, Trajectory, UInt8Array
from rollq.protocol.messages import ErrorRecord, SequenceText


def make_traj(length: int = 6) -> Trajectory:
    seq = Sequence(
        input_ids=Int32Array(range(length)),
        loss_mask=UInt8Array([0, 1] * (length // 2)),
        logprobs=Float32Array([-0.5] * length),
        versions=Int32Array([3] * length),
        reward=0.75,
    )
    return Trajectory(job_id="j1", sample_index=1, n=2, status="ok", sequences=[seq], worker_id="w")


def test_msgpack_round_trip_keeps_token_arrays_and_types():
    codec = Codec()
    traj = make_traj()
    back = codec.decode_trajectory(codec.encode(traj))
    assert back == traj
    assert type(back.sequences[0].input_ids) is Int32Array
    assert back.sequences[0].logprobs.tolist() == [-0.5] * 6


def test_token_arrays_travel_packed_not_as_lists():
    codec = Codec()
    traj = make_traj(1024)
    packed = len(codec.encode(traj))
    as_lists = len(msgspec.msgpack.encode(codec.to_builtins(traj)))
    # 4 + 1 + 4 + 4 bytes per token plus small headers.
    assert packed < 13 * 1024 + 300
    assert packed < as_lists


def test_json_view_is_plain_lists_and_decodes_back():
    codec = Codec()
    traj = make_traj()
    text = codec.encode_json(traj)
    assert b'"input_ids":[0,1,2,3,4,5]' in text
    assert codec.decode(text, Trajectory) == traj


def test_foreign_msgpack_with_plain_lists_is_accepted():
    codec = Codec()
    foreign = msgspec.msgpack.encode(Codec().to_builtins(make_traj()))
    assert codec.decode_trajectory(foreign) == make_traj()


def test_sequence_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="loss_mask has 2 entries but input_ids has 3"):
        Sequence(
            input_ids=Int32Array([1, 2, 3]),
            loss_mask=UInt8Array([1, 1]),
            logprobs=Float32Array([0, 0, 0]),
            versions=Int32Array([0, 0, 0]),
        )


def test_malformed_payloads_raise_codec_error_with_reason():
    codec = Codec()
    with pytest.raises(CodecError, match="cannot decode Job"):
        codec.decode_job(b"\x93\x01\x02")
    with pytest.raises(CodecError, match="job_id"):
        codec.decode_job(b'{"workflow": "x:y"}')
    with pytest.raises(CodecError):
        codec.decode_job(b"not json or msgpack \xc1")


def test_job_json_from_another_language():
    job = Codec().decode_job(b'{"job_id": "a", "workflow": "m:C", "data": {"q": 1}, "n": 4, "sample_index": 3}')
    assert (job.job_id, job.n, job.sample_index, job.data) == ("a", 4, 3, {"q": 1})


def test_error_record_and_defaults_are_omitted_on_the_wire():
    codec = Codec()
    t = Trajectory(job_id="j", sample_index=0, n=1, status="error", error=ErrorRecord(type="E", message="m"))
    assert codec.decode_trajectory(codec.encode(t)).error.message == "m"
    assert b"sequences" not in codec.encode(Job(job_id="j", workflow="m:C"))


def test_arrays_coerce_from_numpy_and_batch_of_one():
    np = pytest.importorskip("numpy")
    assert Int32Array.coerce(np.array([[1, 2, 3]]), "input_ids").tolist() == [1, 2, 3]
    assert Float32Array.coerce(np.array([0.5, 1.5]), "logprobs").tolist() == [0.5, 1.5]
    with pytest.raises(ValueError, match="1-D"):
        Int32Array.coerce(np.zeros((2, 2)), "input_ids")


def test_decoded_text_is_optional_on_the_wire_and_an_older_reader_ignores_it():
    """Job.text and Sequence.text are new fields with defaults: absent from what is encoded unless asked for (the
    bytes of every other job and trajectory are unchanged), carried when set, ignored by a reader that predates them
    (schema stays 1: a worker that ignores `text` publishes no text, and nothing else changes)."""
    codec = Codec()
    assert b"text" not in codec.encode(Job(job_id="j", workflow="m:C"))
    assert b"text" not in codec.encode(make_traj())
    job = codec.decode_job(codec.encode(Job(job_id="j", workflow="m:C", text=True)))
    assert job.text and job.schema == 1
    traj = make_traj()
    traj.sequences[0].text = SequenceText(prompt="<|im_start|>user\nhi", completion=" 42<|im_end|>")
    for encoded in (codec.encode(traj), codec.encode_json(traj)):
        assert codec.decode(encoded, Trajectory) == traj

    class OldSequence(msgspec.Struct, kw_only=True, omit_defaults=True):  # a reader from before `text`
        input_ids: Int32Array
        loss_mask: UInt8Array
        logprobs: Float32Array
        versions: Int32Array
        reward: float = 0.0

    class OldTrajectory(msgspec.Struct, kw_only=True, omit_defaults=True):
        job_id: str
        sample_index: int
        n: int
        status: str
        sequences: list[OldSequence] = []

    old = codec.decode(codec.encode(traj), OldTrajectory)
    assert old.sequences[0].input_ids == traj.sequences[0].input_ids and old.sequences[0].reward == 0.75
