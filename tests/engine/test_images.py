"""`image_data` on /generate (SGLang's field, engine/server/media.py): images travel in the request (base64, data
URIs) and reach the model; paths only under the engine's media_root, URLs only to its image_url_hosts; anything else
is a 400 naming the setting, and a model without vision refuses images rather than generate without them. Real
servers on loopback (the engine, and an HTTP server for the image URLs)."""

from __future__ import annotations

import base64
import io
import random

import pytest
from aiohttp import web
from PIL import Image

from rollq.engine.server.media import MediaPolicy, allowed_host
from rollq.http_server import start_site
from rollq.local import free_port
from tests.engine.test_server_conformance import generate
from tests.helpers import rss_kib

PROMPT = [5, 6, 7, 8]


def png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


RED, BLUE = png((255, 0, 0)), png((0, 0, 255))


def body(images, **extra) -> dict:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6}, "image_data": images, **extra}


async def output_ids(http, url, payload) -> list[int]:
    resp = await generate(http, url, payload)
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


async def test_images_in_the_request_reach_the_model(start_engine, http):
    url = (await start_engine()).url
    red_uri = "data:image/png;base64," + base64.b64encode(RED).decode()
    red = await output_ids(http, url, body(red_uri))
    assert red == await output_ids(http, url, body([base64.b64encode(RED).decode()]))  # raw base64, AReaL's form
    assert red != await output_ids(http, url, body([base64.b64encode(BLUE).decode()]))  # the image matters
    assert red != await output_ids(http, url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6}})
    both = await output_ids(http, url, body([red_uri, base64.b64encode(BLUE).decode()]))
    assert both != red
    # a batch: one entry per prompt
    resp = await generate(http, url, {"input_ids": [PROMPT, PROMPT], "image_data": [red_uri, None]})
    assert resp.status_code == 200 and resp.json()[0]["output_ids"] != resp.json()[1]["output_ids"]


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ("/etc/hostname", "its media_root is unset"),
        ("file:///etc/passwd", "its media_root is unset"),
        ("picture.png", "its media_root is unset"),
        ("http://169.254.169.254/latest/meta-data", "image_url_hosts (none)"),
        ("data:image/png;base64,not base64!", "image_data"),
        (base64.b64encode(b"%PDF-1.7 not an image").decode(), "not an image file"),
    ],
)
async def test_by_default_an_engine_reads_no_files_and_fetches_no_urls(start_engine, http, image, message):
    url = (await start_engine()).url
    resp = await generate(http, url, body([image]))
    assert resp.status_code == 400 and message in resp.text, resp.text


async def test_paths_only_under_the_media_root(start_engine, http, tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "red.png").write_bytes(RED)
    (tmp_path / "secret.png").write_bytes(BLUE)
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    url = (await start_engine(server={"media": MediaPolicy(media_root=str(root), max_image_bytes=4096)})).url
    red = await output_ids(http, url, body([base64.b64encode(RED).decode()]))
    assert await output_ids(http, url, body(["sub/red.png"])) == red
    assert await output_ids(http, url, body([str(root / "sub" / "red.png")])) == red
    for outside in ("../secret.png", str(tmp_path / "secret.png"), "link.png", "sub/missing.png"):
        resp = await generate(http, url, body([outside]))
        assert resp.status_code == 400 and "no such image under the engine's media_root" in resp.text, outside
    (root / "big.png").write_bytes(RED + b"\0" * 5000)
    resp = await generate(http, url, body(["big.png"]))
    assert resp.status_code == 400 and "max_image_bytes=4096" in resp.text


async def test_urls_only_to_allowed_hosts_without_redirects(start_engine, http):
    async def image(_):
        return web.Response(body=RED, content_type="image/png")

    async def redirect(_):
        raise web.HTTPFound("http://127.0.0.1:1/elsewhere.png")

    app = web.Application()
    app.router.add_get("/red.png", image)
    app.router.add_get("/moved.png", redirect)
    runner, port = await start_site(app, "127.0.0.1", 0)
    try:
        url = (await start_engine(server={"media": MediaPolicy(url_hosts=[f"127.0.0.1:{port}"])})).url
        red = await output_ids(http, url, body([base64.b64encode(RED).decode()]))
        assert await output_ids(http, url, body([f"http://127.0.0.1:{port}/red.png"])) == red
        resp = await generate(http, url, body([f"http://127.0.0.1:{port}/moved.png"]))
        assert resp.status_code == 400 and "HTTP 302" in resp.text
        resp = await generate(http, url, body([f"http://localhost:{port}/red.png"]))  # another name: not allowed
        assert resp.status_code == 400 and "only from its image_url_hosts" in resp.text
    finally:
        await runner.cleanup()


async def test_a_model_without_vision_refuses_images(start_engine, http):
    from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig

    url = (await start_engine(backend=ReferenceBackend(ReferenceConfig(model="tiny", max_running=2)))).url
    resp = await generate(http, url, body([base64.b64encode(RED).decode()]))
    assert resp.status_code == 400 and "takes no image input" in resp.text


# -- what one request's images may cost, and URL fetches (security round 2, N3 and N7) ----------------------------


def one_colour_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (3, 4, 5)).save(buf, format="PNG")
    return buf.getvalue()


def noise_png(width: int, height: int) -> bytes:
    """A PNG that does not compress (random pixels): width x height x 3 bytes and a little more."""
    buf = io.BytesIO()
    Image.frombytes("RGB", (width, height), random.Random(7).randbytes(width * height * 3)).save(buf, format="PNG")
    return buf.getvalue()


async def test_a_requests_images_are_bounded_in_count_bytes_and_pixels(start_engine, http, tmp_path):
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "red.png").write_bytes(RED)
    media = MediaPolicy(
        media_root=str(tmp_path / "media"), max_images=4, max_total_bytes=3 * len(RED), max_total_pixels=200
    )
    url = (await start_engine(server={"media": media})).url
    assert await output_ids(http, url, body(["red.png"] * 3))  # 3 x 64 pixels, 3 x its bytes: within
    resp = await generate(http, url, body(["red.png"] * 5))
    assert resp.status_code == 400 and "has 5 images, over max_request_images=4" in resp.text, resp.text
    # all the prompts of a batch count together
    resp = await generate(http, url, {"input_ids": [PROMPT, PROMPT], "image_data": [["red.png"] * 3, ["red.png"] * 2]})
    assert resp.status_code == 400 and "over max_request_images=4" in resp.text, resp.text
    resp = await generate(http, url, body(["red.png"] * 4))
    assert resp.status_code == 400 and "over max_request_image_bytes" in resp.text, resp.text
    big = "data:image/png;base64," + base64.b64encode(png_claiming(100, 100)).decode()  # small file, 10,000 pixels
    resp = await generate(http, url, body([big]))
    assert resp.status_code == 400 and "over max_request_image_pixels=200" in resp.text, resp.text


def png_claiming(width: int, height: int) -> bytes:
    from tests.workers.test_media import png_claiming as claiming

    return claiming(width, height)


async def test_an_engine_process_refuses_an_image_bomb_before_reading_it(engine_process, http, tmp_path):
    """N3: 742 bytes naming one 15 MB file 60 times took an engine to 1.4 GiB; a 4096 x 4096 PNG is 16.7 M pixels
    in tens of KB. Now a request's images are counted, their bytes bounded as they are read and their pixels from
    the headers, all before a backend decodes anything; the engine stays small."""
    media = tmp_path / "media"
    media.mkdir()
    (media / "fat.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 15_000_000)
    (media / "wide.png").write_bytes(one_colour_png(4096, 4096))
    proc, url = await engine_process("--media-root", str(media))
    resp = await generate(http, url, body(["fat.png"] * 60))
    assert resp.status_code == 400 and "over max_request_image_bytes=33,554,432" in resp.text, resp.text
    resp = await generate(http, url, body(["wide.png"] * 8))
    assert resp.status_code == 400 and "over max_request_image_pixels=67,108,864" in resp.text, resp.text
    resp = await generate(http, url, body(["wide.png"] * 1000))
    assert resp.status_code == 400 and "has 1000 images, over max_request_images=64" in resp.text, resp.text
    peak_kib, _ = rss_kib(proc.pid)
    assert peak_kib < 500 * 1024, f"the engine's peak RSS was {peak_kib // 1024} MiB"


async def test_url_images_are_read_whole_within_the_limit_and_only_from_allowed_ports(start_engine, http):
    """N7: a read returned only the first chunk (an image over ~128 KB arrived cut short), max_image_bytes never
    bounded a fetch, any port of an allowed host could be fetched, and errors echoed bytes and host:port."""
    noise = noise_png(300, 300)  # 270,000+ bytes: several chunks, past what one read returned
    assert len(noise) > 2 * 128 * 1024

    async def chunked(_):
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        await resp.prepare(_)
        for at in range(0, len(noise), 16 * 1024):
            await resp.write(noise[at : at + 16 * 1024])  # each chunk its own write: read on to the end
        await resp.write_eof()
        return resp

    async def secret(_):
        return web.Response(body=b"TOPSECRET and more", content_type="text/plain")

    app = web.Application()
    app.router.add_get("/noise.png", chunked)
    app.router.add_get("/secret.png", secret)
    runner, port = await start_site(app, "127.0.0.1", 0)
    closed = free_port()
    try:
        allowed = [f"127.0.0.1:{port}", f"127.0.0.1:{closed}", "localhost"]
        url = (await start_engine(server={"media": MediaPolicy(url_hosts=allowed)})).url
        whole = await output_ids(http, url, body(["data:image/png;base64," + base64.b64encode(noise).decode()]))
        assert await output_ids(http, url, body([f"http://127.0.0.1:{port}/noise.png"])) == whole
        small = (await start_engine(server={"media": MediaPolicy(url_hosts=allowed, max_image_bytes=100_000)})).url
        resp = await generate(http, small, body([f"http://127.0.0.1:{port}/noise.png"]))
        assert resp.status_code == 400 and "over max_image_bytes=100000" in resp.text, resp.text
        # "localhost" names no port: 80 and 443 only
        resp = await generate(http, url, body([f"http://localhost:{port}/noise.png"]))
        assert resp.status_code == 400 and "on ports 80 and 443 unless an entry names its port" in resp.text
        # errors: neither the file's bytes nor the host:port they failed to reach
        for image in (f"http://127.0.0.1:{port}/secret.png", f"http://127.0.0.1:{closed}/x.png"):
            resp = await generate(http, url, body([image]))
            assert resp.status_code == 400, resp.text
            assert "TOPSECRE" not in resp.text and f":{port}" not in resp.text and f":{closed}" not in resp.text
            assert "127.0.0.1" not in resp.text, resp.text
    finally:
        await runner.cleanup()


async def test_no_error_echoes_a_files_bytes(start_engine, http, tmp_path):
    (tmp_path / "secret.png").write_text("TOPSECRET: not an image")
    url = (await start_engine(server={"media": MediaPolicy(media_root=str(tmp_path))})).url
    resp = await generate(http, url, body(["secret.png"]))
    assert resp.status_code == 400 and "not an image file" in resp.text and "TOPSECRE" not in resp.text, resp.text


def test_a_url_hosts_entry_must_be_host_or_host_port():
    assert allowed_host("Imgs.Example:8080") == ("imgs.example", 8080) and allowed_host("[::1]") == ("::1", None)
    for bad in ("", "http://x", "x:port", "x/y", "u@x"):
        with pytest.raises(ValueError, match="is not HOST or HOST:PORT"):
            MediaPolicy(url_hosts=[bad])
