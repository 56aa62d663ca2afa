"""A job's images reach its workflow ready to use (PIL in `data["images"]`, data URIs elsewhere), through a real
worker and Redis; an image that can't be opened dead-letters its job by name, and the worker goes on."""

import asyncio
import io
import json
import struct
import zlib

import pytest
from PIL import Image

from rollq.producer import Producer
from rollq.producer.producer import JobRequest
from rollq.protocol import Codec
from rollq.protocol.image_limits import ImageLimits
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from rollq.protocol.media import ImageFile
from rollq.protocol.messages import AgentOptions
from rollq.workers.media import DEFAULT_MAX_PIXELS, JobImages, MediaError, open_image, prepare_images
from tests.helpers import rss_kib, running_worker
from tests.workers.agents.test_command_agent import exec_spec, run_jobs, script
from tests.workers.agents.test_command_agent import stack as stack  # a fixture: the command agents' engine


def png_claiming(width: int, height: int) -> bytes:
    """A PNG file whose header declares width x height and holds one tiny row of data (a decompression bomb's
    shape: a small file, a huge canvas)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 4)) + chunk(b"IEND", b"")
    )


def test_images_become_pil_in_images_and_data_uris_elsewhere():
    raw = ImageFile(Codec().decode_data(Codec().encode(Image.new("RGB", (4, 4), (7, 8, 9)))))
    data = prepare_images({"images": [raw, raw.data_uri(), "not-an-image.png"], "msg": [{"url": raw}], "n": 1})
    first, second, third = data["images"]
    assert first.getpixel((0, 0)) == second.getpixel((0, 0)) == (7, 8, 9) and third == "not-an-image.png"
    assert data["msg"][0]["url"] == raw.data_uri() and data["n"] == 1
    assert prepare_images([raw]) == [raw.data_uri()] and prepare_images("text") == "text"


def test_an_image_over_the_pixel_limit_is_refused_from_its_header():
    with pytest.raises(MediaError, match=r"4000x4000 pixels is over the worker's max_image_pixels=1000000"):
        open_image(ImageFile(png_claiming(4000, 4000)), max_pixels=1_000_000)
    with pytest.raises(MediaError, match=r"over the worker's max_image_pixels=1000000"):  # over PIL's bound too
        open_image(ImageFile(png_claiming(100_000, 100_000)), max_pixels=1_000_000)
    with pytest.raises(MediaError, match="does not decode"):  # within the limit, but truncated
        open_image(ImageFile(png_claiming(64, 64)))


async def test_a_workflow_gets_its_images_and_a_bad_one_dead_letters_its_job(redis, redis_url, run_name):
    producer = Producer(redis, run_name)
    red = Image.new("RGB", (8, 8), (201, 0, 0))
    part = ImageFile(Codec().decode_data(Codec().encode(red)))
    async with running_worker(redis_url, run_name, max_image_pixels=1_000_000) as worker:
        await producer.submit("tests.workflows:SeeImages", {"images": [red], "part": part}, job_id="pil", n=2)
        await producer.submit("tests.workflows:SeeImages", {"images": [part.data_uri()]}, job_id="uri")
        await producer.submit(
            "tests.workflows:SeeImages", {"images": [ImageFile(png_claiming(4000, 4000))]}, job_id="bomb"
        )
        results = producer.wait_for({"pil": 2, "uri": 1, "bomb": 1}, timeout_s=20)
        trajs = {(t.job_id, t.sample_index): t async for t in results}
    assert [trajs["pil", i].sequences[0].reward for i in range(2)] == [1201.0, 1201.0]
    assert trajs["uri", 0].sequences[0].reward == 201.0
    bomb = trajs["bomb", 0]
    assert bomb.status == "error" and bomb.error.type == "BadImage" and "max_image_pixels=1000000" in bomb.error.message
    letters = [Codec().decode_dead_letter(f[PAYLOAD_FIELD]) for _, f in await redis.xrange(RunKeys(run_name).dead)]
    assert [(lt.error.type, lt.job.job_id) for lt in letters] == [("BadImage", "bomb")]
    assert worker.stats.completed == 3 and worker.stats.dead_lettered == 1


# -- what one job's images may cost (security round 2, N2 and N10) ---------------------------------------------------


def one_colour_png(width: int, height: int) -> bytes:
    """A real PNG of one colour: small on the wire (tens of KB at 4096 x 4096), huge decoded."""
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (9, 9, 9)).save(buf, format="PNG")
    return buf.getvalue()


def test_the_images_of_a_job_are_bounded_together_before_any_is_decoded():
    small = ImageFile(one_colour_png(64, 64))
    limits = ImageLimits(max_images=3, max_bytes=10_000, max_pixels=3 * 64 * 64)
    assert len(prepare_images({"images": [small] * 3}, limits=limits)["images"]) == 3
    with pytest.raises(MediaError, match="has 4 images, over max_job_images=3"):
        prepare_images({"images": [small] * 2, "msg": [small.data_uri(), small]}, limits=limits)
    with pytest.raises(MediaError, match="over max_job_image_pixels=12,288"):  # a header claiming more, never decoded
        prepare_images({"images": [small, ImageFile(png_claiming(100, 100))]}, limits=limits)
    with pytest.raises(MediaError, match="over max_job_image_bytes=10,000"):
        prepare_images({"images": [ImageFile(small + b"\0" * 10_000)]}, limits=limits)


async def test_a_jobs_images_are_decoded_once_for_all_its_samples():
    images = JobImages(DEFAULT_MAX_PIXELS, ImageLimits())
    png = ImageFile(one_colour_png(32, 32))
    data = {"images": [png, "text"], "part": png}
    (a, key_a), (b, key_b) = await asyncio.gather(images.acquire("d1", data), images.acquire("d1", dict(data)))
    assert a["images"][0] is b["images"][0] and a["images"][1] == "text"  # one decode, shared
    assert a is not b and a["images"] is not b["images"]  # each sample its own containers
    assert a["part"] == png.data_uri() and key_a == key_b == "d1" and len(images) == 1
    images.release("d1")
    images.release("d1")
    assert len(images) == 0  # dropped with its last sample
    (c, _) = await images.acquire("d1", data)
    assert c["images"][0] is not a["images"][0]  # decoded again once nothing held it
    # a command agent (raw) gets them as data URIs, as they came: nothing decoded, nothing held
    raw, held = await images.acquire("d1", {"images": [png, png.data_uri()]}, raw=True)
    assert raw == {"images": [png.data_uri(), png.data_uri()]} and held is None


async def test_an_image_bomb_dead_letters_its_job_in_a_worker_process_without_decoding(
    redis, redis_url, run_name, spawn_worker
):
    """N2: 16 PNGs of 4096 x 4096 (one colour: about 1 MB in all) and n = 2 took a worker to 4.4 GiB. Now the job's
    pixels are counted from the headers and it is dead-lettered before anything is decoded."""
    bomb = ImageFile(one_colour_png(4096, 4096))
    worker = spawn_worker(redis_url, run_name, "--concurrency", "4", "--max-attempts", "1")
    producer = Producer(redis, run_name)
    await producer.submit("tests.workflows:SeeImages", {"images": [bomb] * 16}, job_id="pixels", n=2)
    await producer.submit("tests.workflows:SeeImages", {"images": [ImageFile(png_claiming(8, 8))] * 100}, job_id="many")
    trajs = [t async for t in producer.wait_for({"pixels": 2, "many": 1}, timeout_s=60)]
    errors = {
        (t.job_id, t.sample_index): (t.status, t.error and t.error.type, t.error and t.error.message) for t in trajs
    }
    for i in (0, 1):
        status, kind, message = errors["pixels", i]
        assert status == "error" and kind == "BadImage" and "max_job_image_pixels=67,108,864" in message, message
    status, kind, message = errors["many", 0]
    assert status == "error" and kind == "BadImage" and "has 100 images, over max_job_images=64" in message, message
    peak_kib, _ = rss_kib(worker.proc.pid)
    assert peak_kib < 500 * 1024, f"the worker's peak RSS was {peak_kib // 1024} MiB"


async def test_a_job_asking_for_a_longer_agent_timeout_than_the_worker_allows_is_dead_lettered(
    redis, redis_url, run_name
):
    producer = Producer(redis, run_name)
    async with running_worker(redis_url, run_name, max_agent_timeout=60.0):
        await producer.submit_many(
            [JobRequest(workflow="tests.workflows:Echo", job_id="long", agent=AgentOptions(timeout_seconds=1e9))]
        )
        [t] = [t async for t in producer.wait_for({"long": 1}, timeout_s=20)]
    assert t.status == "error" and t.error.type == "AgentTimeoutTooLong", t.error
    assert "agent.timeout_seconds=1e+09 is over the worker's max_agent_timeout=60" in t.error.message


async def test_a_command_agent_gets_a_jobs_images_as_they_came(redis, redis_url, run_name, stack, tmp_path):
    """N10: a command agent failed on any job with images in data["images"] ("Encoding objects of type Image is
    unsupported"); it now gets them as data URIs (from the JSON as they were sent, from msgpack as the file's)."""
    seen = tmp_path / "seen.json"
    agent = script(tmp_path, "see.sh", f"cat > {seen}\necho null\n")
    seen.touch()
    seen.chmod(0o666)
    png = ImageFile(one_colour_png(8, 8))
    [t] = await run_jobs(
        redis,
        redis_url,
        run_name,
        stack,
        exec_spec(agent),
        allow=[f"command:{tmp_path}/*"],
        data={"images": [png, png.data_uri()], "question": "what colour?"},
    )
    assert t.status == "rejected", t.error  # the agent ran, and printed null
    assert json.loads(seen.read_text()) == {"images": [png.data_uri()] * 2, "question": "what colour?"}
