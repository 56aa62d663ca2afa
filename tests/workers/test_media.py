"""A job's images reach its workflow ready to use (PIL in `data["images"]`, data URIs elsewhere), through a real
worker and Redis; an image that can't be opened dead-letters its job by name, and the worker goes on."""

import struct
import zlib

import pytest
from PIL import Image

from rollq.producer import Producer
from rollq.protocol import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from rollq.protocol.media import ImageFile
from rollq.workers.media import MediaError, open_image, prepare_images
from tests.helpers import running_worker


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
