"""rollq's LoRA serving against SGLang 0.5.5's own source (the wheel from the package registry, unpacked into the
cache; nothing of it is copied here): the flags `rollq engine --backend sglang` passes exist in its argument parser,
its routes are the ones the reference engine serves, and the error messages rollq's engine answers with are its
words."""

from __future__ import annotations

import pytest

from rollq.engine.server.commands import lora_flags
from rollq.engine.server.config import EngineConfig
from tests.third_party import unpacked

pytestmark = pytest.mark.slow

SGLANG = "sglang==0.5.5"


@pytest.fixture(scope="module")
def srt():
    return unpacked(SGLANG) / "sglang" / "srt"


def test_the_lora_flags_rollq_passes_are_sglangs(srt):
    server_args = (srt / "server_args.py").read_text()
    config = EngineConfig(
        backend="sglang",
        lora_paths=["a=/adapters/a"],
        max_loras_per_batch=4,
        max_loaded_loras=6,
        max_lora_rank=16,
        lora_target_modules=["q_proj", "v_proj"],
    )
    flags = lora_flags(config)
    assert flags[:3] == ["--enable-lora", "--max-loras-per-batch", "4"]
    assert "--lora-paths" in flags and "a=/adapters/a" in flags
    for flag in (f for f in flags if f.startswith("--")):
        assert f'"{flag}"' in server_args, flag
    assert lora_flags(EngineConfig(backend="sglang")) == []


def test_the_routes_and_messages_are_sglangs(srt):
    from rollq.engine.server.lora_registry import NOT_ENABLED

    http_server = (srt / "entrypoints" / "http_server.py").read_text()
    assert '"/load_lora_adapter"' in http_server and '"/unload_lora_adapter"' in http_server
    sources = "".join(
        (srt / path).read_text()
        for path in (
            "lora/lora_manager.py",
            "lora/lora_registry.py",
            "managers/tokenizer_communicator_mixin.py",
            "managers/io_struct.py",
        )
    )
    for words in (
        NOT_ENABLED,
        "because it is already loaded",
        "does not exist. Loaded LoRAs:",
        "The following requested LoRA adapters are not loaded: {name}\\n",
        "Maximum number of loaded LoRA adapters is",
        "lora_path should be a list or a string.",
        "loaded_adapters",
        "error_message",
    ):
        assert words in sources, words
