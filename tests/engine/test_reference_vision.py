"""The reference engine serving the tiny Qwen2-VL (a real architecture, built offline): its answers with images are
what transformers' own generate gives for the same inputs, alone or batched beside text and other images (each row
its own multimodal rope), with the placeholder as one token or already expanded; a mismatch is a 400."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
import torch
from PIL import Image

from rollq.engine.models import model_dir
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig
from rollq.engine.tiny_vlm import load_processor
from tests.engine.test_server_conformance import generate

pytestmark = pytest.mark.slow

NEW = 8


def png(colour) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), colour).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForImageTextToText

    path = model_dir("tiny-vl")
    return AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).eval(), load_processor(path)


def prompt(processor, text: str, images: int) -> str:
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    return processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def expected(hf, text: str, colours: list) -> tuple[list[int], list[int]]:
    """(the expanded prompt ids, transformers' greedy continuation) for `text` with images of `colours`."""
    model, processor = hf
    images = [Image.open(io.BytesIO(base64.b64decode(png(c)))).convert("RGB") for c in colours]
    inputs = processor(images=images or None, text=prompt(processor, text, len(colours)), return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids) :].tolist()


def body(ids: list[int], colours: list) -> dict:
    extra = {"image_data": [png(c) for c in colours]} if colours else {}
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}, **extra}


async def test_answers_with_images_match_transformers(start_engine, http, hf):
    _, processor = hf
    url = (await start_engine(backend=ReferenceBackend(ReferenceConfig(model="tiny-vl", max_running=8)))).url
    cases = [("Which colour?", [(200, 0, 0)]), ("Which colour?", [(0, 0, 200)]), ("Two?", [(0, 200, 0), (9, 9, 9)])]
    cases.append(("No image here.", []))
    wanted = [expected(hf, text, colours) for text, colours in cases]
    assert wanted[0][1] != wanted[1][1]  # the image decides the answer
    # alone, with the placeholder as the chat template writes it (one token per image): expanded by the engine
    short = [processor.tokenizer(prompt(processor, t, len(c)))["input_ids"] for t, c in cases]
    resp = await generate(http, url, body(short[0], cases[0][1]))
    assert resp.status_code == 200 and resp.json()["output_ids"] == wanted[0][1]
    assert resp.json()["meta_info"]["prompt_tokens"] == len(wanted[0][0])  # counted expanded, as SGLang
    # all at once, already expanded (AReaL's form): one batch of rows with different rope deltas, and a text row
    replies = await asyncio.gather(
        *(generate(http, url, body(ids, c)) for (ids, _), (_, c) in zip(wanted, cases, strict=True))
    )
    assert [r.json()["output_ids"] for r in replies] == [out for _, out in wanted]


async def test_placeholders_that_do_not_fit_the_images_are_refused(start_engine, http, hf):
    _, processor = hf
    url = (await start_engine(backend=ReferenceBackend(ReferenceConfig(model="tiny-vl", max_running=2)))).url
    ids = processor.tokenizer(prompt(processor, "Which colour?", 1))["input_ids"]
    resp = await generate(http, url, body(ids, [(1, 2, 3), (4, 5, 6)]))
    assert resp.status_code == 400 and "2 image(s) but the prompt has 1 image placeholder(s)" in resp.text
    pad = processor.tokenizer.image_token_id
    i = ids.index(pad)
    resp = await generate(http, url, body(ids[:i] + [pad] * 3 + ids[i + 1 :], [(1, 2, 3)]))
    assert resp.status_code == 400 and "placeholder of 3 tokens" in resp.text and "its image takes 4" in resp.text
    resp = await generate(http, url, body(ids, []))  # placeholders and no pictures: the request's error alone
    assert resp.status_code == 400 and "image placeholders (token" in resp.text and "no image_data" in resp.text
    resp = await generate(http, url, {"input_ids": [ids, ids[-3:]], "image_data": [png((1, 2, 3)), None]})
    assert resp.status_code == 200 and len(resp.json()) == 2  # a batch: one prompt with a picture, one without


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_a_paused_row_with_images_resumes_where_it_was(hf, mode):
    """Retracted, a row with images is prefilled again from its prompt, partial output and images; in place it
    keeps its KV and rope delta. Either way: the uninterrupted answer."""
    from rollq.engine.server.backend import GenState
    from rollq.engine.types import SamplingParams
    from rollq.protocol.media import ImageFile
    from tests.helpers import wait_until

    backend = ReferenceBackend(ReferenceConfig(model="tiny-vl", max_running=4))
    await backend.start()
    try:
        ids, want = expected(hf, "Which colour?", [(200, 0, 0)])
        image = ImageFile(base64.b64decode(png((200, 0, 0))))
        state = GenState("v", ids, SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))
        state.input_ids, state.vision = await asyncio.to_thread(backend.prepare_images, ids, [image])
        state.images = [image]
        task = asyncio.create_task(backend.run(state))
        await wait_until(lambda: len(state.output_ids) >= 3, 20, 0.002, what="3 tokens")
        await backend.pause(mode)
        assert len(state.output_ids) < NEW
        await backend.resume()
        await asyncio.wait_for(task, 20)
        assert state.output_ids == want
    finally:
        await backend.close()


def test_the_placeholder_count_is_checked_before_any_image_is_decoded(hf):
    """N3: the reference backend decoded every image to RGB before it counted the prompt's placeholders. Images that
    would fail to decode (headers of a huge canvas, no pixel data) now meet the count first."""
    from rollq.engine.server.vision import ImageInputs, ImageRequestError
    from rollq.protocol.media import ImageFile
    from tests.workers.test_media import png_claiming

    _, processor = hf
    inputs = ImageInputs(processor, processor.tokenizer.image_token_id, max_pixels=4096 * 4096)
    ids = processor.tokenizer(prompt(processor, "Which colour?", 1))["input_ids"]
    bombs = [ImageFile(png_claiming(4000, 4000))] * 2
    with pytest.raises(ImageRequestError, match=r"2 image\(s\) but the prompt has 1 image placeholder\(s\)"):
        inputs.prepare(ids, bombs)
    with pytest.raises(ImageRequestError, match="does not decode"):  # the count fits: decoded, and refused
        inputs.prepare(ids, bombs[:1])
