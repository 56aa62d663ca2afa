"""LoRA adapters of a MoE model on the reference engine (issue 42's E3). The engine runs every batch as one of peft's
mixed-adapter batches (`adapter_names`, engine/server/lora_slots.py), which peft refuses for Parameters adapted
directly (lora.ParamWrapper: on transformers 5 a MoE's router and fused experts) and for DoRA. So:

- the rollq trainer's adapter (`all-linear`: the linear layers, trainer/lora.py) of the tiny Qwen3-MoE serves in a
  batch beside the base model, each row with the logprobs of its own model;
- an adapter peft cannot batch is refused at /load_lora_adapter, a 400 naming what it holds, and the engine goes on
  serving the adapters it has: peft's own all-linear adapter (router and experts as target_parameters), one whose
  config says `all-linear` (peft converts that to the same when loading), a DoRA adapter; and at start
  (`lora_paths`) the engine refuses to start with one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig
from rollq.trainer.config import TrainConfig
from rollq.trainer.lora import ADAPTER_CONFIG, write_adapter
from rollq.trainer.policy import Policy
from tests.engine.test_lora_serving import body, load, tokens_and_logprobs
from tests.families import build_family
from tests.trainer.test_policy import batch_of_two

pytestmark = pytest.mark.slow

FAMILY = "qwen3_moe"
PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42, 43, 44]]
REFUSED = ("stock", "all-linear", "dora")


def peft_adapter(directory: Path, model: Path, **config) -> Path:
    """An adapter as peft itself writes it for `model` (random A and B)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    settings = {"r": 4, "lora_alpha": 8, "init_lora_weights": False, **config}
    get_peft_model(base, LoraConfig(**settings)).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Policy, dict[str, Path]]:
    """The trainer after two LoRA steps on the tiny Qwen3-MoE, its adapter, and adapters peft cannot batch."""
    root = tmp_path_factory.mktemp("adapters")
    model = build_family(FAMILY)
    policy = Policy(TrainConfig(model=str(model), lora_rank=4, lora_alpha=8, lr=5e-2))
    batch = batch_of_two(policy)
    for _ in range(2):
        policy.train_step(batch)
    adapters = {"trainer": write_adapter(root / "trainer", policy.model)}
    adapters["stock"] = peft_adapter(root / "stock", model, target_modules="all-linear")
    converted = shutil.copytree(adapters["trainer"], root / "all-linear")  # peft rewrites this at load time
    config = json.loads((converted / ADAPTER_CONFIG).read_text())
    (converted / ADAPTER_CONFIG).write_text(json.dumps({**config, "target_modules": "all-linear"}))
    adapters["all-linear"] = converted
    adapters["dora"] = peft_adapter(root / "dora", model, target_modules=["q_proj", "v_proj"], use_dora=True)
    return policy, adapters


@pytest.fixture
async def moe_engine(start_engine, trained, tmp_path):
    """`start(**server)`: a reference engine on the tiny Qwen3-MoE with LoRA on, the adapters under its weights root."""
    for name, path in trained[1].items():
        shutil.copytree(path, tmp_path / name)

    async def start(**server):
        backend = ReferenceBackend(ReferenceConfig(model=str(build_family(FAMILY))))
        return await start_engine(server={"enable_lora": True, **server}, backend=backend)

    return start


def own_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    """log p of each output token under `model` given what precedes it."""
    ids = torch.tensor([prompt + output])
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


async def test_the_trainers_adapter_serves_beside_the_base_model_with_each_rows_own_logprobs(
    moe_engine, trained, http, tmp_path
):
    from transformers import AutoModelForCausalLM

    policy, _ = trained
    engine = await moe_engine()
    resp = await load(http, engine.url, "t", tmp_path / "trainer")
    assert resp.status_code == 200, resp.text
    out = await http.post(engine.url + "/generate", json=body(["t", None], PROMPTS))
    assert out.status_code == 200, out.text
    (adapted, adapted_lps), (plain, plain_lps) = (tokens_and_logprobs(o) for o in out.json())
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in out.json())
    assert adapted_lps == pytest.approx(own_logprobs(policy.model, PROMPTS[0], adapted), abs=1e-4)
    base = AutoModelForCausalLM.from_pretrained(build_family(FAMILY), dtype=torch.float32)
    assert plain_lps == pytest.approx(own_logprobs(base, PROMPTS[1], plain), abs=1e-4)
    # the adapter is applied: the base model gives the adapted row other logprobs
    assert own_logprobs(base, PROMPTS[0], adapted) != pytest.approx(adapted_lps, abs=1e-2)


async def test_adapters_peft_cannot_batch_are_refused_at_load_naming_why_and_serving_goes_on(
    moe_engine, http, tmp_path
):
    engine = await moe_engine()
    assert (await load(http, engine.url, "t", tmp_path / "trainer")).status_code == 200
    before = [
        tokens_and_logprobs(o)
        for o in (await http.post(engine.url + "/generate", json=body(["t", None], PROMPTS))).json()
    ]
    expect = {
        "stock": ["target_parameters", "gate.weight", "gate_up_proj", "down_proj", "lora.ParamWrapper"],
        "all-linear": ["target_parameters", "gate.weight", "gate_up_proj", "down_proj"],
        "dora": ["DoRA"],
    }
    for name in REFUSED:
        resp = await load(http, engine.url, name, tmp_path / name)
        assert resp.status_code == 400, (name, resp.text)
        reply = resp.json()
        assert reply["success"] is False and reply["loaded_adapters"] == {"t": str(tmp_path / "trainer")}
        message = reply["error_message"]
        assert message.startswith(f"Failed to load LoRA adapter {name}: UnservableAdapter:"), message
        assert "mixed-adapter batches" in message and all(words in message for words in expect[name]), message
    after = await http.post(engine.url + "/generate", json=body(["t", None], PROMPTS))
    assert after.status_code == 200  # the model was left as it was: the same tokens and logprobs
    for (tokens, lps), (was_tokens, was_lps) in zip(
        (tokens_and_logprobs(o) for o in after.json()), before, strict=True
    ):
        assert tokens == was_tokens and lps == pytest.approx(was_lps, abs=1e-5)  # (now from the prefix cache)
    refused = await http.post(engine.url + "/generate", json=body("stock"))
    assert refused.status_code == 400 and "not loaded: stock" in refused.json()["error"]["message"]


async def test_an_engine_refuses_to_start_with_such_an_adapter(moe_engine, tmp_path):
    with pytest.raises(RuntimeError, match=r"Failed to load LoRA adapter s.*target_parameters"):
        await moe_engine(lora_paths=[f"s={tmp_path / 'stock'}"])
