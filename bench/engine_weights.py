"""Weight update time, disk vs distributed (JSON summary as the last line).

For the tiny model and for a random-init model of SmolLM2-135M's shape (Llama, hidden 576, 30 layers, vocab 49152,
tied embeddings; built in memory, nothing downloaded), onto 1 and 2 in-process reference engines (float32, CPU):
- disk: the trainer writes safetensors (Policy.save_weights' way), every engine loads them (/update_weights_from_disk);
- distributed: the trainer broadcasts the tensors over a gloo group (rollq.engine.weight_group); the first update
  builds the group (cold), the next ones reuse it (warm).
Seconds per update (median of `repeat`) and bytes moved (disk: written once + read by each engine; distributed: sent
to each engine). Engines and trainer share this process and its cores, as on one host.

  python -m bench.engine_weights [--repeat N]
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/engine_weights.py`: the repository root on sys.path)

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import print_summary
from bench.results import add_results_arg, write_results

if TYPE_CHECKING:
    import torch

    from rollq.engine.server.app import ServerHandle

# torch, transformers and the engine load in the functions that use them, so `--help` answers at once.

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def smollm2_shaped(directory: Path, tokenizer_from: Path) -> Path:
    """A random-init model with SmolLM2-135M's shape, saved where a reference engine can load it (the tiny model's
    tokenizer: the engines only load weights here, they generate nothing)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, directory / name)
    return directory


def perturbed(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """New weights, as a training step would publish them (contiguous CPU float32, like the trainer's)."""
    return {n: p.detach() + 1e-3 * step for n, p in model.named_parameters()}


def save(tensors: dict[str, torch.Tensor], directory: Path) -> int:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    file = directory / "model.safetensors"
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(file))
    return file.stat().st_size


async def measure(model_dir: Path, engines: int, repeat: int, work: Path) -> dict[str, Any]:
    from rollq.engine.pool import EnginePool, PoolConfig
    from rollq.engine.server.app import EngineServerConfig, serve
    from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig
    from rollq.engine.weight_group import DistributedSyncConfig, DistributedWeightSync

    handles: list[ServerHandle] = []
    pool = EnginePool(PoolConfig())
    sync = DistributedWeightSync(pool, DistributedSyncConfig(timeout_s=120.0))
    try:
        for _ in range(engines):
            backend = ReferenceBackend(ReferenceConfig(model=str(model_dir), max_running=4))
            handles.append(await serve(backend, EngineServerConfig(host="127.0.0.1", port=0, weights_root=str(work))))
            pool.add(handles[-1].url)
        model = handles[0].server.backend.model
        members = pool.engines()
        disk_s, save_s, file_bytes = [], [], 0
        for i in range(repeat):
            tensors = perturbed(model, i + 1)
            t0 = time.monotonic()
            file_bytes = await asyncio.to_thread(save, tensors, work / f"v{i}")
            t1 = time.monotonic()
            await asyncio.gather(
                *(m.client.update_weights_from_disk(str(work / f"v{i}"), weight_version=f"d{i}") for m in members)
            )
            t2 = time.monotonic()
            disk_s.append(t2 - t0)
            save_s.append(t1 - t0)
            shutil.rmtree(work / f"v{i}", ignore_errors=True)
        dist_s, sent = [], 0
        cold = await sync.update(perturbed(model, 100), "c")
        assert not cold.failed, cold.failed
        for i in range(repeat):
            result = await sync.update(perturbed(model, 200 + i), f"w{i}")
            assert not result.failed and not result.rebuilt, result
            dist_s.append(result.seconds)
            sent = result.bytes_sent
        params = sum(p.numel() for p in model.parameters())
        return {
            "engines": engines,
            "params": params,
            "disk_s": statistics.median(disk_s),
            "disk_save_s": statistics.median(save_s),
            "disk_bytes_moved": file_bytes * (1 + engines),  # written once, read by every engine
            "distributed_cold_s": cold.seconds,  # includes building the group
            "distributed_s": statistics.median(dist_s),
            "distributed_bytes_moved": sent * engines,  # every engine receives every tensor
            "speedup": statistics.median(disk_s) / statistics.median(dist_s),
        }
    finally:
        await sync.close()
        await pool.close()
        for h in handles:
            await h.close()


async def disk_vs_distributed(repeat: int = 1) -> dict:
    """Update seconds and bytes moved, disk vs distributed, per model and engine count (see the module doc)."""
    from rollq.engine.tiny_model import build_tiny

    out: dict[str, Any] = {"repeat": repeat, "rows": []}
    with tempfile.TemporaryDirectory(prefix="rollq-bench-weights-") as tmp:
        root = Path(tmp)
        tiny = build_tiny(root / "cache" / "tiny-model")
        models = {"tiny": tiny, "smollm2-135m-shape": smollm2_shaped(root / "smollm2", tiny)}
        for name, directory in models.items():
            for engines in (1, 2):
                row = await measure(directory, engines, repeat, root / "work")
                out["rows"].append({"model": name, **row})
    return out


def table(out: dict[str, Any]) -> str:
    head = (
        f"{'model':<20}{'eng':>4}{'params':>12}{'disk s':>9}{'(save)':>9}{'disk MB':>9}"
        f"{'dist s':>9}{'cold s':>9}{'dist MB':>9}{'speedup':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in out["rows"]:
        lines.append(
            f"{r['model']:<20}{r['engines']:>4}{r['params']:>12,}{r['disk_s']:>9.3f}{r['disk_save_s']:>9.3f}"
            f"{r['disk_bytes_moved'] / 1e6:>9.1f}{r['distributed_s']:>9.3f}{r['distributed_cold_s']:>9.3f}"
            f"{r['distributed_bytes_moved'] / 1e6:>9.1f}{r['speedup']:>8.1f}x"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="updates measured per path (median)")
    add_results_arg(p)
    args = p.parse_args()
    out = asyncio.run(disk_vs_distributed(args.repeat))
    print()
    print(table(out))
    print_summary(out)
    write_results("engine_weights", out, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
