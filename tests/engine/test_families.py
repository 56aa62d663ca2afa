"""Every architecture family users commonly bring, served by the reference engine as transformers serves it.

For each tiny model of tests/families.py, through a real engine server on loopback: greedy output equals transformers'
`generate`; a GRPO-shaped burst (8 + 8 concurrent requests on two prompts, one request with `n = 8` on a third,
retracted by a pause and resumed midway) completes with no abort, its groups decoding against their shared prompt
(the cascade) wherever the model's attention allows it; every sampled token's logprob equals the trainer's on the
same tokens (fp32); a LoRA adapter as the trainer makes it serves next to the base model what peft gives; a weight
delta the trainer takes of its own parameters is prepared and swapped in bit for bit (the trainer's names are the
engine's, tied and fused weights included). The
windowed families' prompts are longer than their window, so a window not applied shows. Plus the models the
engine refuses when it starts, each with a message that names what is missing.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollq.engine.server.backend import ModelRefused  # noqa: E402
from rollq.engine.server.kv_batch import CASCADE  # noqa: E402
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig  # noqa: E402
from rollq.local import wait_until  # noqa: E402
from rollq.trainer.config import TrainConfig  # noqa: E402
from tests.engine.sharing import watch_sharing  # noqa: E402
from tests.families import FAMILIES, WINDOW, build_family  # noqa: E402

pytestmark = pytest.mark.slow

GROUP = 8
NEW = 48  # room to pause the burst midway, and to decode past the window (rows that see none of their prefix)
TOLERANCE = 1e-4  # fp32 logprobs, engine vs trainer


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 500, (n,), generator=g).tolist()


PROMPTS = {"a": prompt(1, 64), "b": prompt(2, 80), "c": prompt(3, 72)}  # shared prefixes beyond the cascade's floor


def params(**extra) -> dict:
    return {"max_new_tokens": NEW, "temperature": 1.0, "ignore_eos": True, **extra}


async def generate(http, url: str, body: dict) -> list[dict]:
    resp = await http.post(url + "/generate", json={"return_logprob": True, **body})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return out if isinstance(out, list) else [out]


def sampled(out: dict) -> tuple[list[int], list[float]]:
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def trainer_policy(model_dir: Path):
    """The trainer's policy of the model (trainer/policy.py, fp32)."""
    from rollq.trainer.policy import Policy

    return Policy(TrainConfig(model=str(model_dir)))


def trainer_logprobs(policy, prompt_ids: list[int], outs: list[dict]) -> list[list[float]]:
    """What the trainer computes for each sample's tokens."""
    got = []
    with torch.no_grad():
        for out in outs:
            ids = torch.tensor([[*prompt_ids, *out["output_ids"]]])
            lps = policy.token_logprobs(ids, torch.ones_like(ids))[0]
            got.append(lps[len(prompt_ids) - 1 :].tolist())
    return got


def make_adapter(model_dir: Path, directory: Path) -> Path:
    """A LoRA adapter of the model as the trainer configures it (trainer/lora.py), with random A and B so that it
    changes the outputs."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from rollq.trainer.lora import lora_config

    torch.manual_seed(7)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = lora_config(TrainConfig(model=str(model_dir), lora_rank=4), base, model_dir)
    config.init_lora_weights = False
    get_peft_model(base, config).save_pretrained(str(directory))
    return directory


def greedy_reference(model_dir: Path, prompt_ids: list[int], new: int, adapter: Path | None = None) -> list[int]:
    """transformers' own greedy generate, through peft with an adapter. No EOS (ignore_eos: an EOS is sampled like
    any token and does not stop; min_new_tokens would mask it instead)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # generate's defaults come from here, whatever a call passes
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    assert out.shape[1] == len(prompt_ids) + new
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_a_family_is_served_as_transformers_serves_it(family, start_engine, http, tmp_path) -> None:
    model_dir = build_family(family)
    backend = ReferenceBackend(ReferenceConfig(model=str(model_dir), max_running=64))
    engine = await start_engine(server={"enable_lora": True}, backend=backend)
    # Gemma 2's softcapping needs eager attention (its class refuses SDPA): served, without shared-prefix decode
    cascade = family != "gemma2"
    assert backend.attention == (CASCADE if cascade else "eager")

    # greedy: what transformers' generate gives
    a = PROMPTS["a"]
    (out,) = await generate(http, engine.url, {"input_ids": a, "sampling_params": params(temperature=0.0)})
    assert out["output_ids"] == greedy_reference(model_dir, a, NEW)

    # the GRPO-shaped burst, held at the pause gate until all of it has arrived (so it is admitted at once, as a
    # group's samples are, whatever the machine's load), then paused with retract and resumed midway
    seen = watch_sharing(backend)
    assert (await http.post(engine.url + "/pause_generation", json={"mode": "in_place"})).status_code == 200
    calls = [{"input_ids": PROMPTS[k], "sampling_params": params()} for k in ("a", "b") for _ in range(GROUP)]
    calls.append({"input_ids": PROMPTS["c"], "sampling_params": params(n=GROUP)})
    burst = [asyncio.create_task(generate(http, engine.url, c)) for c in calls]
    await wait_until(lambda: len(engine.server.states) == 3 * GROUP, 30, what="the burst at the gate")
    assert (await http.post(engine.url + "/continue_generation", json={})).status_code == 200
    await wait_until(lambda: seen, 30, interval_s=0.001, what="the burst's first decode step")
    assert (await http.post(engine.url + "/pause_generation", json={"mode": "retract"})).status_code == 200
    assert (await http.post(engine.url + "/continue_generation", json={})).status_code == 200
    results = [o for outs in await asyncio.gather(*burst) for o in outs]
    assert len(results) == 3 * GROUP
    assert [o["meta_info"]["finish_reason"]["type"] for o in results] == ["length"] * (3 * GROUP)
    assert sum(o["meta_info"]["num_retractions"] for o in results) > 0  # the pause met rows mid-decode
    shared = max(n for _, n in seen)
    assert shared >= 2 * GROUP if cascade else shared == 0  # the groups decode against one copy of their prompt

    # every sampled token's logprob is the trainer's
    policy = trainer_policy(model_dir)
    for key, outs in (("a", results[:GROUP]), ("b", results[GROUP : 2 * GROUP]), ("c", results[2 * GROUP :])):
        expected = trainer_logprobs(policy, PROMPTS[key], outs)
        for o, want in zip(outs, expected, strict=True):
            assert sampled(o)[1] == pytest.approx(want, abs=TOLERANCE), key

    # a LoRA adapter, in one batch with the base model
    adapter = make_adapter(model_dir, tmp_path / "adapter")
    load = await http.post(engine.url + "/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapter)})
    assert load.status_code == 200, load.text
    with_adapter = greedy_reference(model_dir, a, NEW, adapter)
    assert with_adapter != out["output_ids"]  # the adapter changes the output: the check can fail
    greedy = params(temperature=0.0)
    outs = await generate(http, engine.url, {"input_ids": [a, a], "sampling_params": greedy, "lora_path": ["x", None]})
    assert [o["output_ids"] for o in outs] == [with_adapter, out["output_ids"]]

    await delta_round_trip(policy, engine.url, http, tmp_path)


async def delta_round_trip(policy, url: str, http, weights_root: Path) -> None:
    """The trainer's parameters (trainer/policy.py, the names it publishes), one Adam-sized step on each, as a
    delta from the version the engine serves: prepared, swapped in, and the engine's checksums are the new ones."""
    from rollq.engine import weight_delta

    base = {name: t.to(torch.float32) for name, t in policy.full_parameters() if t is not None}
    g = torch.Generator().manual_seed(5)
    new = {name: t - 1e-3 * torch.sign(torch.randn(t.shape, generator=g)) for name, t in base.items()}
    served = (await http.get(url + "/model_info")).json()["weight_version"]
    delta = weight_delta.encode(base, new, base_version=served, version="1")
    path = weight_delta.write(weights_root / "d1", delta)
    prepared = await http.post(url + "/rollq/prepare_weights", json={"model_path": str(path), "weight_version": "1"})
    assert prepared.status_code == 200, prepared.text
    swap = await http.post(url + "/update_weights_from_disk", json={"model_path": prepared.json()["load_path"]})
    assert swap.status_code == 200, swap.text
    report = (await http.get(url + "/rollq/weights_checksum")).json()
    assert report["weight_version"] == "1"
    assert report["checksums"] == {name: weight_delta.checksum(t) for name, t in new.items()}


def test_the_windowed_families_prompts_cross_their_window() -> None:
    assert min(len(p) for p in PROMPTS.values()) > 3 * WINDOW


async def test_an_attention_that_cannot_serve_the_model_is_refused_at_start() -> None:
    backend = ReferenceBackend(ReferenceConfig(model=str(build_family("gemma2")), attn_implementation="sdpa"))
    with pytest.raises(ModelRefused, match="attn_implementation 'sdpa' cannot serve .*Gemma2ForCausalLM"):
        await backend.start()


async def test_a_model_the_engine_cannot_serve_is_refused_at_start_by_name(tmp_path) -> None:
    """A recurrent model (Mamba: a cache of its own, no attention): refused when the engine starts, by its class and
    what failed, instead of aborting every request."""
    from transformers import MambaConfig, MambaForCausalLM

    from rollq.engine.tiny_model import TinySpec, build_tokenizer

    tok = build_tokenizer(TinySpec())
    MambaForCausalLM(MambaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(ModelRefused, match="MambaForCausalLM names no context length"):
        await ReferenceBackend(ReferenceConfig(model=str(tmp_path))).start()
    with pytest.raises(ModelRefused, match="MambaForCausalLM cannot be served by the reference engine"):
        await ReferenceBackend(ReferenceConfig(model=str(tmp_path), context_length=256)).start()


async def test_a_model_the_cascade_does_not_serve_right_is_served_without_it(tmp_path, caplog) -> None:
    """Falcon runs attention its own way (not through transformers' AttentionInterface), so shared-prefix decode
    would not reach it: the start-up check finds the cascade's log-probs wrong and the engine serves the model with
    plain SDPA, saying so, instead of serving wrong logprobs."""
    from transformers import FalconConfig, FalconForCausalLM

    from rollq.engine.tiny_model import TinySpec, build_tokenizer

    tok = build_tokenizer(TinySpec())
    config = FalconConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    config.initializer_range = 0.2
    torch.manual_seed(0)
    FalconForCausalLM(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    backend = ReferenceBackend(ReferenceConfig(model=str(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="rollq.engine.server.reference"):
        await backend.start()
    try:
        assert backend.attention == "sdpa" and not backend._batch.cascade
        assert "FalconForCausalLM is served without shared-prefix decode" in caplog.text
    finally:
        await backend.close()
