"""`rollq export`: a run's checkpoint as a Hugging Face model directory that transformers and the engines load."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from rollq.engine.models import model_dir
from rollq.trainer import checkpoint
from rollq.trainer.checkpoint import TrainerState
from rollq.trainer.config import TrainConfig
from rollq.trainer.hf_export import MARKER, ExportConfig, export, export_run
from rollq.trainer.policy import Policy
from tests.helpers import REPO_ROOT

PROMPT = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"


def rollq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollq", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.umask(0o022),  # the command's own umask, the usual one a user's shell sets
    )


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Policy]:
    """A run directory whose checkpoint holds weights that differ from the tiny model's."""
    run_dir = tmp_path_factory.mktemp("run")
    policy = Policy(TrainConfig(model="tiny"))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    checkpoint.save(run_dir, policy, TrainerState(run_id="x", model="tiny", step=3, version=3))
    return run_dir, policy


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory) -> Path:
    """`rollq export RUN_DIR --out OUT` as a real command."""
    run_dir, _ = trained
    out = tmp_path_factory.mktemp("export") / "model"
    res = rollq("export", str(run_dir), "--out", str(out))
    assert res.returncode == 0, res.stderr
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert line == {"out": str(out), "step": 3, "version": 3, "model": "tiny"}
    return out


def test_the_export_is_the_trained_model_with_the_base_tokenizer(trained, exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, policy = trained
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", MARKER} <= names
    assert json.loads((exported / MARKER).read_text())["version"] == 3
    assert not [p for p in exported.parent.iterdir() if p.name.startswith(".")]  # no temp dir left beside it

    base_tok = AutoTokenizer.from_pretrained(model_dir("tiny"))
    tok = AutoTokenizer.from_pretrained(exported)
    assert tok.chat_template == base_tok.chat_template
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == PROMPT
    assert tok.encode(PROMPT) == base_tok.encode(PROMPT)
    assert tok.eos_token == base_tok.eos_token

    ids = torch.tensor([base_tok.encode(PROMPT)])
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir("tiny"), dtype=torch.float32).eval()
    policy.model.eval()
    want = logits_of(policy.model, ids)
    assert torch.allclose(logits_of(model, ids), want, atol=1e-5)
    assert not torch.allclose(logits_of(base, ids), want, atol=1e-2)
    assert model.generation_config.eos_token_id == base.generation_config.eos_token_id


def modes_under(out: Path) -> dict[str, int]:
    return {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [out, *out.rglob("*")]}


def test_the_export_follows_the_umask_like_any_file_the_user_writes(trained, exported, tmp_path):
    """F15: it was 0700 whatever the umask, so a server running as another user could not read it."""
    modes = modes_under(exported)  # `rollq export` under umask 022
    assert "model.safetensors" in modes and "tokenizer_config.json" in modes
    assert modes == {name: 0o755 if (exported / name).is_dir() else 0o644 for name in modes}
    # a private umask keeps it private
    run_dir, _ = trained
    private = tmp_path / "private"
    before = os.umask(0o077)
    try:
        export_run(run_dir, private)
    finally:
        os.umask(before)
    assert set(modes_under(private).values()) == {0o700, 0o600}


def test_a_missing_checkpoint_exits_2_naming_it(tmp_path):
    res = rollq("export", str(tmp_path / "no-such-run"), "--out", str(tmp_path / "out"))
    assert res.returncode == 2
    assert res.stderr.strip().startswith("rollq export:") and "no checkpoint" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_out_is_required(tmp_path):
    res = rollq("export", str(tmp_path))
    assert res.returncode == 2 and "out is required" in res.stderr and "--out" in res.stderr


def test_a_foreign_out_is_refused_and_a_previous_export_replaced(trained, tmp_path, capsys):
    run_dir, _ = trained
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert export(ExportConfig(run_dir=str(run_dir), out=str(foreign))) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollq export:") and "not empty" in err and str(foreign) in err
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]

    out = tmp_path / "model"
    out.mkdir()  # an empty directory is fine
    export_run(run_dir, out)
    (out / "stale.bin").write_text("from the previous export")
    assert export(ExportConfig(run_dir=str(run_dir), out=str(out), dtype="bfloat16")) == 0
    assert json.loads(capsys.readouterr().out)["out"] == str(out)
    assert not (out / "stale.bin").exists()
    assert json.loads((out / MARKER).read_text())["dtype"] == "bfloat16"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_unknown_or_wrong_base_model_is_a_clear_error(trained, tmp_path, capsys):
    run_dir, policy = trained
    old = tmp_path / "old-run"
    old.mkdir()
    checkpoint.save(old, policy, TrainerState(run_id="x", step=1, version=1))  # no model
    assert export(ExportConfig(run_dir=str(old), out=str(tmp_path / "a"))) == 2
    err = capsys.readouterr().err
    assert "--model" in err and len(err.strip().splitlines()) == 1

    assert export(ExportConfig(run_dir=str(old), out=str(tmp_path / "b"), model=str(tmp_path / "nowhere"))) == 2
    assert "cannot load base model" in capsys.readouterr().err

    weights = dict(policy.model.state_dict())
    weights.pop(next(iter(weights)))
    bad = tmp_path / "bad-run"
    written = checkpoint.save(bad, policy, TrainerState(run_id="x", model="tiny"))
    for part in written.glob("*.distcp"):  # the same checkpoint with a weight missing: written again without it
        part.unlink()
    (written / ".metadata").unlink()
    dcp.save({"model": weights}, checkpoint_id=str(written))
    assert export(ExportConfig(run_dir=str(bad), out=str(tmp_path / "c"))) == 2
    err = capsys.readouterr().err
    assert "do not match base model 'tiny'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "c").exists()


@pytest.mark.scenario  # an engine process on the export: what any HF directory gets (the chaos loop runs it)
async def test_the_reference_engine_serves_the_export(exported, engine_process):
    import httpx
    from transformers import AutoTokenizer

    _, url = await engine_process("--backend", "reference", "--model", str(exported))
    tok = AutoTokenizer.from_pretrained(exported)
    async with httpx.AsyncClient() as http:
        body = {"input_ids": tok.encode(PROMPT), "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        resp = await http.post(url + "/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert 1 <= len(out["output_ids"]) <= 4
    assert all(0 <= t < len(tok) for t in out["output_ids"])
