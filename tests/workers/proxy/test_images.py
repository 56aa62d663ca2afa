"""Images through the recording proxy, on real servers on loopback (a scripted engine on the tiny vision-language
model's tokenizer, the real EnginePool, the openai SDK): chat `image_url` and Responses `input_image` parts become the
processor's image tokens, the engine gets the images, and every record's sequences carry all the images of its
conversation so far (both exports, both continuations, multi-turn); what the proxy can't take is a 400 saying why."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from rollq.engine.models import model_dir
from rollq.engine.tiny_vlm import load_processor
from rollq.protocol import Codec
from rollq.protocol.messages import VisionInputs
from rollq.workers.agents.export import assign_rewards, export
from rollq.workers.outputs import to_sequences
from rollq.workers.proxy.server import ProxyConfig
from tests.workers.proxy.helpers import make_stack

REPLIES = ["It is red.", "That one is blue."]


def png(colour: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", (56, 56), colour)


def data_uri(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


RED, BLUE = png((220, 20, 20)), png((20, 20, 220))


def user(text: str, image: Image.Image | None = None) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_uri(image)}}] if image is not None else []
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def reference(messages: list[dict], images: list[Image.Image]) -> dict:
    """What the model's processor makes of the conversation: its chat template, image parts as image placeholders,
    then each placeholder expanded into its image's tokens."""
    processor = load_processor(model_dir("tiny-vl"))
    as_template = [
        {**m, "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]
    text = processor.apply_chat_template(as_template, add_generation_prompt=True, tokenize=False)
    out = processor(images=images, text=text, return_tensors="np")
    return {k: (v[0].tolist() if k in ("input_ids", "mm_token_type_ids") else v) for k, v in out.items()}


def vision_of(seq) -> VisionInputs:
    assert seq.vision is not None and seq.vision.inline is not None
    return Codec().decode(seq.vision.inline, VisionInputs)


def pixels(vision: VisionInputs) -> np.ndarray:
    return np.frombuffer(vision.pixel_values.to_bytes(), dtype=np.float32).reshape(vision.pixel_shape)


@pytest.fixture
async def vl_stack(request):
    continuation = getattr(request, "param", "exact")
    async with make_stack(REPLIES, ProxyConfig(continuation=continuation), tokenizer="tiny-vl") as s:
        yield s


@pytest.mark.parametrize("vl_stack", ["exact", "template"], indirect=True)
async def test_images_become_the_processors_tokens_and_every_turn_keeps_them(vl_stack):
    stack = vl_stack
    session = stack.proxy.sessions.open()
    client = stack.openai(session.key)
    first_messages = [user("Which colour is it?", RED)]
    first = await client.chat.completions.create(model="m", messages=first_messages, max_tokens=16, logprobs=True)
    assert first.choices[0].message.content == REPLIES[0]
    # The second turn repeats the first image and adds another: its prompt holds both, in order.
    messages = [*first_messages, {"role": "assistant", "content": REPLIES[0]}, user("And this one?", BLUE)]
    stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=16, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == REPLIES[1]

    r1, r2 = session.ordered()
    assert r2.parent == r1.key
    for rec, want, images in (
        (r1, reference(first_messages, [RED]), [RED]),
        (r2, reference(messages, [RED, BLUE]), [RED, BLUE]),
    ):
        # Token-exact: the prompt is the processor's, whichever way the proxy built it (exact: the first turn's
        # prompt + output, then only the new turn, its image expanded on its own).
        assert rec.prompt_ids == want["input_ids"]
        assert rec.vision.mm_token_type_ids == want["mm_token_type_ids"] and sum(want["mm_token_type_ids"]) == 4 * len(
            images
        )
        assert np.array_equal(rec.vision.pixel_values, want["pixel_values"])
        assert rec.vision.images == [data_uri(i) for i in images]
        # The engine got the images: its tokens for this prompt depend on them.
        assert await stack.direct(rec.prompt_ids, 16, rec.vision.images) == (rec.output_ids, rec.output_logprobs)
        assert (await stack.direct(rec.prompt_ids, 16))[1] != rec.output_logprobs
    assert r2.prompt_ids[: len(r1.full_ids)] == r1.full_ids  # both ways here: the template renders turns as a suffix

    assign_rewards(session.ordered(), 1.0)
    first_seq, second_seq = to_sequences(export(session.ordered(), "individual", 1.0))
    [branch] = to_sequences(export(session.ordered(), "concat", 1.0))
    assert list(branch.input_ids) == r2.full_ids and branch.reward == 1.0
    for seq, rec in ((first_seq, r1), (second_seq, r2), (branch, r2)):
        vision = vision_of(seq)
        assert np.array_equal(pixels(vision), rec.vision.pixel_values)
        assert list(vision.image_grid_thw) == [1, 4, 4] * len(rec.vision.images)
        types = list(vision.mm_token_type_ids)
        assert len(types) == len(seq.input_ids) and types[: len(rec.prompt_ids)] == rec.vision.mm_token_type_ids
        assert not any(types[len(rec.prompt_ids) :])  # the model's text


async def test_responses_input_image_and_a_continuation_that_keeps_it(vl_stack):
    stack = vl_stack
    session = stack.proxy.sessions.open()
    client = stack.openai(session.key)
    content = [
        {"type": "input_image", "image_url": data_uri(RED), "detail": "auto"},
        {"type": "input_text", "text": "Which colour is it?"},
    ]
    first = await client.responses.create(model="m", input=[{"role": "user", "content": content}])
    second = await client.responses.create(model="m", previous_response_id=first.id, input="Are you sure?")
    assert (first.output_text, second.output_text) == tuple(REPLIES)
    r1, r2 = session.ordered()
    assert r1.prompt_ids == reference([user("Which colour is it?", RED)], [RED])["input_ids"]
    assert r2.parent == r1.key and r2.prompt_ids[: len(r1.full_ids)] == r1.full_ids
    assert r2.vision.images == [data_uri(RED)] and r2.vision.mm_token_type_ids[: len(r1.prompt_ids)] == (
        r1.vision.mm_token_type_ids
    )
    assert first.usage.input_tokens == len(r1.prompt_ids)  # image tokens counted, as the model sees them


async def test_a_completions_prompt_that_extends_an_image_turn_keeps_its_image(vl_stack):
    stack = vl_stack
    session = stack.proxy.sessions.open()
    client = stack.openai(session.key)
    await client.chat.completions.create(model="m", messages=[user("Which colour?", RED)], max_tokens=16)
    [r1] = session.ordered()
    await client.completions.create(model="m", prompt=r1.full_ids + [201], max_tokens=4)
    r2 = session.ordered()[-1]
    assert r2.parent == r1.key and r2.vision.images == r1.vision.images
    assert r2.vision.mm_token_type_ids == r1.vision.mm_token_type_ids + [0] * (len(r2.prompt_ids) - len(r1.prompt_ids))
    [branch] = to_sequences(export(session.ordered(), "concat", 1.0))
    assert len(vision_of(branch).mm_token_type_ids) == len(r2.full_ids)


async def post(stack, session, path: str, body: dict):
    return await stack.context.http_client().post(
        f"{stack.proxy.base_url}/{path}", headers={"Authorization": f"Bearer {session.key}"}, json=body
    )


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        (
            "chat/completions",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]}
                ]
            },
            "image URLs are not supported: the recording proxy fetches no URLs",
        ),
        (
            "responses",
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x.test/a.png"}]}]},
            "image URLs are not supported",
        ),
        (
            "responses",
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
            "by file_id are not supported",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_uri(RED)}}]}]},
            "images are supported in user messages only",
        ),
        (
            "chat/completions",
            {
                "messages": [
                    user("hi"),
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}}],
                    },
                ]
            },
            "not an image file",
        ),
        (
            "chat/completions",  # a placeholder of the text's own: the processor counts two and has one image
            {"messages": [user("<|vision_start|><|image_pad|><|vision_end|>", RED)]},
            "the model's processor refused the prompt",
        ),
    ],
)
async def test_images_the_proxy_cannot_take_are_a_400_saying_why(vl_stack, path, body, words):
    session = vl_stack.proxy.sessions.open()
    resp = await post(vl_stack, session, path, {"model": "m", "max_tokens": 4, **body})
    assert resp.status_code == 400 and words in resp.json()["error"]["message"], resp.text
    assert not session.records


async def test_a_text_model_refuses_images_rather_than_drop_them(stack):
    session = stack.proxy.sessions.open()
    resp = await post(stack, session, "chat/completions", {"model": "m", "messages": [user("Which colour?", RED)]})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"].startswith("this model takes no images:"), resp.text
    assert not session.records
    resp = await post(stack, session, "chat/completions", {"model": "m", "messages": [user("hi")], "max_tokens": 4})
    assert resp.status_code == 200, resp.text  # text still works
