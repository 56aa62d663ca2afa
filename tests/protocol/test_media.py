"""Images on the wire: PIL in, an ImageFile extension on msgpack, a data URI in JSON; nothing else decodes as one."""

import base64
import io

import msgspec
import pytest
from PIL import Image

from rollq.protocol import Codec
from rollq.protocol.codec import CodecError
from rollq.protocol.media import IMAGE_EXT_CODE, ImageError, ImageFile, image_from_string, media_type_of
from rollq.protocol.messages import Job


def png(colour=(200, 10, 10), size=(8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def test_a_pil_image_in_job_data_travels_as_an_image_file_extension():
    codec = Codec()
    job = Job(job_id="j", workflow="w", data={"images": [Image.new("RGB", (8, 8), (200, 10, 10))], "answer": "red"})
    payload = codec.encode(job)
    assert isinstance(msgspec.msgpack.decode(payload)["data"]["images"][0], msgspec.msgpack.Ext)  # not a bin
    back = codec.decode_job(payload)
    image = back.data["images"][0]
    assert isinstance(image, ImageFile) and image.media_type == "image/png"
    assert Image.open(io.BytesIO(image)).getpixel((0, 0)) == (200, 10, 10)  # lossless
    assert codec.decode_job(codec.encode(back)).data == back.data  # an ImageFile re-encodes as itself
    assert back.data["answer"] == "red"


def test_json_carries_an_image_as_a_data_uri():
    codec = Codec()
    raw = png()
    out = msgspec.json.decode(codec.encode_json(Job(job_id="j", workflow="w", data={"images": [ImageFile(raw)]})))
    uri = out["data"]["images"][0]
    assert uri.startswith("data:image/png;base64,") and image_from_string(uri) == raw


@pytest.mark.parametrize(
    ("head", "media_type"),
    [(b"\x89PNG\r\n\x1a\n0000", "image/png"), (b"\xff\xd8\xff\xe0", "image/jpeg"), (b"GIF89a", "image/gif"),
     (b"RIFF\x00\x00\x00\x00WEBPVP8 ", "image/webp"), (b"<svg xmlns=", None), (b"", None)],
)  # fmt: skip
def test_media_types_come_from_magic_bytes(head, media_type):
    assert media_type_of(head) == media_type


def test_bytes_that_are_no_image_do_not_decode_as_one():
    codec = Codec()
    payload = msgspec.msgpack.encode(
        {"job_id": "j", "workflow": "w", "data": msgspec.msgpack.Ext(IMAGE_EXT_CODE, b"<svg")}
    )
    with pytest.raises(CodecError, match="not an image file"):
        codec.decode_job(payload)
    with pytest.raises(ImageError):
        ImageFile(b"%PDF-1.7")


def test_image_strings_are_data_uris_or_base64_never_paths_or_urls():
    raw = png()
    assert image_from_string(base64.b64encode(raw).decode()) == raw
    assert image_from_string("data:image/png;base64," + base64.b64encode(raw).decode()) == raw
    for text in ("/etc/passwd", "http://169.254.169.254/latest", "file:///etc/hosts", "data:text/plain;base64,aGk="):
        with pytest.raises(ImageError):
            image_from_string(text)
