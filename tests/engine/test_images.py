"""`image_data` on /generate (SGLang's field, engine/server/media.py): images travel in the request (base64, data
URIs) and reach the model; paths only under the engine's media_root, URLs only to its image_url_hosts; anything else
is a 400 naming the setting, and a model without vision refuses images rather than generate without them. Real
servers on loopback (the engine, and an HTTP server for the image URLs)."""

from __future__ import annotations

import base64
import io

import pytest
from aiohttp import web
from PIL import Image

from rollq.engine.server.media import MediaPolicy
from rollq.http_server import start_site
from tests.engine.test_server_conformance import generate

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
