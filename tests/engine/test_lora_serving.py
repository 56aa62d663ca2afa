"""SGLang's LoRA serving on rollq's engine (engine/server/lora_routes.py, lora_registry.py, the reference backend's
mixed-adapter batches), against the facts of SGLang 0.5.5's source (/work/notes: docs/sglang-protocol.md "LoRA"):
the routes' bodies, replies and status codes, `lora_path` by adapter name on /generate, /v1/models, unloads waiting
for the requests in flight. What a row generates with its adapter is checked against peft itself: the same tokens
and logprobs as `PeftModel` greedy-decoding the prompt alone."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch

from rollq.engine.models import model_dir
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9, 10]
NEW = 6


def make_adapter(directory: Path, seed: int, targets: list[str] | str = "all-linear") -> Path:
    """A PEFT adapter of the tiny model with random A and B (peft's init_lora_weights=False): it changes outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir("tiny"), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(str(directory))
    return directory


def peft_greedy(adapter: Path | None, prompt: list[int], new: int = NEW) -> tuple[list[int], list[float]]:
    """What peft's own model generates greedily (the reference for a row with that adapter), with logprobs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("tiny"), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    ids, out, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(new):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            t = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[t]))
            out.append(t)
            ids.append(t)
    return out, lps


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(root / "a", 1),
        "b": make_adapter(root / "b", 2, ["q_proj", "v_proj"]),
        "outside": make_adapter(tmp_path_factory.mktemp("elsewhere") / "c", 3),
    }


@pytest.fixture
async def lora_engine(start_engine, adapters, tmp_path):
    """A reference engine with LoRA on, adapters readable under its weights root (tmp_path)."""
    for name in ("a", "b"):
        shutil.copytree(adapters[name], tmp_path / name)

    async def start(**server):
        backend = ReferenceBackend(ReferenceConfig(model="tiny", max_loras_per_batch=server.pop("per_batch", 8)))
        return await start_engine(server={"enable_lora": True, **server}, backend=backend)

    return start


def body(lora_path=None, prompts=None, new=NEW, **extra) -> dict:
    prompts = prompts or [PROMPT]
    params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    return {
        "input_ids": prompts if len(prompts) > 1 else prompts[0],
        "sampling_params": params,
        "return_logprob": True,
        **({"lora_path": lora_path} if lora_path is not None else {}),
        **extra,
    }


def tokens_and_logprobs(out: dict) -> tuple[list[int], list[float]]:
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


async def load(http, url, name, path, **extra):
    return await http.post(url + "/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})


async def test_load_and_unload_reply_as_sglang(lora_engine, http, tmp_path, adapters):
    engine = await lora_engine()
    url = engine.url
    resp = await load(http, url, "a", tmp_path / "a")
    assert resp.status_code == 200
    assert resp.json() == {"success": True, "error_message": "", "loaded_adapters": {"a": str(tmp_path / "a")}}
    again = await load(http, url, "a", tmp_path / "b")  # lora_manager.py:172-179: a name is loaded once
    assert again.status_code == 400 and again.json()["success"] is False
    assert again.json()["error_message"] == "Failed to load LoRA adapter a because it is already loaded"
    outside = await load(http, url, "c", adapters["outside"])  # rollq: only from under weights_root
    assert outside.status_code == 400 and "weights_root" in outside.json()["error_message"]
    assert "c" not in outside.json()["loaded_adapters"]
    not_peft = tmp_path / "junk"
    not_peft.mkdir()
    (not_peft / "adapter_config.json").write_text("{]")
    junk = await load(http, url, "j", not_peft)
    assert junk.status_code == 400 and junk.json()["error_message"].startswith("Failed to load LoRA adapter j")
    missing_field = await http.post(url + "/load_lora_adapter", json={"lora_name": "x"})
    assert missing_field.status_code == 400 and "lora_path" in missing_field.json()["message"]

    models = (await http.get(url + "/v1/models")).json()["data"]  # http_server.py:1169-1198
    base = models[0]["id"]
    assert [m["id"] for m in models] == [base, "a"]
    assert models[1]["root"] == str(tmp_path / "a") and models[1]["parent"] == base
    assert models[1]["max_model_len"] is None

    unknown = await http.post(url + "/unload_lora_adapter", json={"lora_name": "zz"})
    assert unknown.status_code == 400  # lora_registry.py:101-106
    assert unknown.json()["error_message"].startswith("LoRA with name zz does not exist. Loaded LoRAs:")
    assert unknown.json()["loaded_adapters"] is None
    gone = await http.post(url + "/unload_lora_adapter", json={"lora_name": "a"})
    assert gone.status_code == 200 and gone.json() == {"success": True, "error_message": "", "loaded_adapters": {}}
    assert len((await http.get(url + "/v1/models")).json()["data"]) == 1


async def test_an_engine_without_lora_refuses_adapters(start_engine, http, tmp_path, adapters):
    engine = await start_engine(backend=ReferenceBackend(ReferenceConfig(model="tiny")))
    shutil.copytree(adapters["a"], tmp_path / "a")
    resp = await load(http, engine.url, "a", tmp_path / "a")
    message = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."  # tokenizer_communicator_mixin:488
    assert resp.status_code == 400 and resp.json() == {
        "success": False,
        "error_message": message,
        "loaded_adapters": None,
    }
    # SGLang's /generate would serve the base model, silently; rollq's engine says why it will not
    gen = await http.post(engine.url + "/generate", json=body("a"))
    assert gen.status_code == 400 and gen.json()["error"]["message"] == message


async def test_a_batch_mixing_adapters_and_the_base_model_gives_each_row_what_peft_gives(lora_engine, http, tmp_path):
    """One prompt three times in one call: with adapter a, the base model, adapter b. Each row is what peft alone
    generates for it (the prefix cache keeps the three apart), and again once all three are cached."""
    engine = await lora_engine()
    for name in ("a", "b"):
        assert (await load(http, engine.url, name, tmp_path / name)).status_code == 200
    expected = [peft_greedy(tmp_path / "a", PROMPT), peft_greedy(None, PROMPT), peft_greedy(tmp_path / "b", PROMPT)]
    assert len({tuple(t) for t, _ in expected}) == 3  # the adapters change the outputs: the check can fail
    for _ in range(2):
        resp = await http.post(engine.url + "/generate", json=body(["a", None, "b"], [PROMPT] * 3))
        assert resp.status_code == 200
        for out, (tokens, lps) in zip(resp.json(), expected, strict=True):
            got_tokens, got_lps = tokens_and_logprobs(out)
            assert got_tokens == tokens
            assert got_lps == pytest.approx(lps, abs=1e-4)
    one = await http.post(engine.url + "/generate", json=body("b", [PROMPT, [*PROMPT, 11]]))
    assert [o["output_ids"] for o in one.json()][0] == expected[2][0]  # a string applies to every prompt


async def test_an_unknown_adapter_on_generate_is_sglangs_400(lora_engine, http, tmp_path):
    engine = await lora_engine()
    await load(http, engine.url, "a", tmp_path / "a")
    resp = await http.post(engine.url + "/generate", json=body(["a", "nope"], [PROMPT, PROMPT]))
    assert resp.status_code == 400  # lora_registry.py:121-126
    message = resp.json()["error"]["message"]
    assert message.startswith("The following requested LoRA adapters are not loaded: nope\nLoaded adapters:")
    bad_type = await http.post(engine.url + "/generate", json=body(5))
    assert (
        bad_type.status_code == 400 and bad_type.json()["error"]["message"] == "lora_path should be a list or a string."
    )
    ok = await http.post(engine.url + "/generate", json=body("a"))  # nothing was counted for the refused call
    assert ok.status_code == 200 and engine.server.adapters.in_use(engine.server.adapters.refs()[0]) == 0


async def test_an_unload_waits_for_requests_in_flight_and_new_ones_are_refused(lora_engine, http, tmp_path):
    """tokenizer_communicator_mixin.py:565-576: unregister, wait until its requests finished, then unload; none is
    aborted, and the adapter's name is refused from the moment the unload began."""
    engine = await lora_engine()
    await load(http, engine.url, "a", tmp_path / "a")
    long = asyncio.create_task(http.post(engine.url + "/generate", json=body("a", new=400)))
    ref = engine.server.adapters.refs()[0]
    await wait_until(lambda: engine.server.adapters.in_use(ref) == 1 and engine.server.running == 1, 10)
    unload = asyncio.create_task(http.post(engine.url + "/unload_lora_adapter", json={"lora_name": "a"}))
    await wait_until(lambda: "a" not in engine.server.adapters, 10, what="the name to be unregistered")
    refused = await http.post(engine.url + "/generate", json=body("a"))
    assert refused.status_code == 400 and "not loaded: a" in refused.json()["error"]["message"]
    assert not unload.done()  # still waiting for the long request
    finished = await long
    assert finished.status_code == 200
    assert finished.json()["meta_info"]["finish_reason"]["type"] == "length"
    assert len(finished.json()["output_ids"]) == 400
    assert (await unload).status_code == 200


async def test_a_name_loaded_again_serves_its_new_weights_not_the_cached_ones(lora_engine, http, tmp_path):
    """Unloaded and loaded again from other files: the new weights serve (a spare slot of the same shape takes
    them, engine/server/lora_slots.py, or a new one for another shape), never KV cached under the old ones."""
    make_adapter(tmp_path / "a2", 5)  # a's shape, other weights
    engine = await lora_engine()
    slots = engine.server.backend._slots
    for path, reused in (("a", 0), ("a2", 1), ("b", 1)):
        assert (await load(http, engine.url, "x", tmp_path / path)).status_code == 200
        out = (await http.post(engine.url + "/generate", json=body("x"))).json()
        assert out["output_ids"] == peft_greedy(tmp_path / path, PROMPT)[0], path
        assert slots.reused == reused, path
        await http.post(engine.url + "/unload_lora_adapter", json={"lora_name": "x"})


async def test_lora_paths_load_at_start_and_a_full_update_keeps_the_adapters(lora_engine, http, tmp_path):
    """--lora-paths NAME=PATH (server_args.py:3804-3813); the base weights replaced under a loaded adapter."""
    engine = await lora_engine(lora_paths=[f"a={tmp_path / 'a'}"], per_batch=2)
    assert engine.server.adapters.loaded() == {"a": str(tmp_path / "a")}
    weights = tmp_path / "weights"
    shutil.copytree(model_dir("tiny"), weights)
    resp = await http.post(engine.url + "/update_weights_from_disk", json={"model_path": str(weights)})
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    out = (await http.post(engine.url + "/generate", json=body(["a", None], [PROMPT, PROMPT]))).json()
    assert out[0]["output_ids"] == peft_greedy(tmp_path / "a", PROMPT)[0]
    assert out[1]["output_ids"] == peft_greedy(None, PROMPT)[0]


async def test_rollq_engine_flags_serve_adapters(engine_process, http, tmp_path, adapters):
    """`rollq engine --lora-paths NAME=PATH` (lora_paths implies enable_lora, as in SGLang); the synthetic backend
    (a fast start: the flags are the point here; what the reference backend generates is checked above)."""
    shutil.copytree(adapters["a"], tmp_path / "a")
    _, url = await engine_process("--lora-paths", f"a={tmp_path / 'a'}", "--max-loras-per-batch", "2")
    assert [m["id"] for m in (await http.get(url + "/v1/models")).json()["data"]][1:] == ["a"]
    resp = await http.post(url + "/generate", json=body(["a", None], [PROMPT, PROMPT]))
    assert resp.status_code == 200 and len(resp.json()) == 2
    unknown = await http.post(url + "/generate", json=body("b"))
    assert unknown.status_code == 400 and "not loaded: b" in unknown.json()["error"]["message"]
