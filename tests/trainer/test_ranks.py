"""The trainer on N ranks (torchrun, FSDP2 over gloo): the update one process takes, tied weights kept tied, half
the memory per rank at 2, and sharded checkpoints that resume on another number of ranks (2 -> 1 and 1 -> 2); and
for each architecture family of tests/families.py, two steps of full fine-tuning and two of LoRA on 2 ranks that take
the update of one.

Each 2-rank run is a real `torch.distributed.run` of tests/trainer/rank_script.py; the 1-rank runs are the same
script in this process (no process group, as `rollq train` without torchrun). Starting torchrun and its Python
processes is what costs, not the tiny models: CI's one start also trains the CI families (llama; gemma2: eager
attention for its softcapping, a windowed layer, an embedding scale its checkpoint does not hold; qwen3_moe: fused
3-D experts its checkpoint stores per expert), and the scenario's one more start the other six."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollq.engine.models import model_dir
from tests.families import FAMILIES, build_family
from tests.helpers import REPO_ROOT
from tests.trainer import rank_script
from tests.trainer.test_families import one_thread  # noqa: F401 (a fixture: the families' 1-rank runs)

pytestmark = pytest.mark.slow

SCRIPT = Path(rank_script.__file__)
TOLERANCE = 1e-5  # of the largest parameter's magnitude (float32)
CI_FAMILIES = ("llama", "gemma2", "qwen3_moe")  # the rest: scenario
FAMILY_LORA_RANK = 4


def tied_tiny(directory: Path) -> Path:
    """The tiny model with its lm_head tied to the embedding (as SmolLM2's and Qwen2-0.5B's are): the config says
    so and the weights hold the embedding once."""
    shutil.copytree(model_dir("tiny"), directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(directory / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, directory / "model.safetensors")
    return directory


def two_ranks(*args: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]


def one_rank(*args: str) -> None:
    rank_script.main(list(args))


def weights(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest parameter difference over the largest parameter magnitude. Per element it means little: where a
    gradient is rounding noise (a key bias, whose gradient softmax all but cancels) AdamW's first step turns noise
    of either sign into +-lr, in one process as on two."""
    assert a.keys() == b.keys()
    scale = max(float(t.abs().max()) for t in a.values())
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


def facts(out: Path, rank: int = 0) -> dict:
    return json.loads((out / f"rank-{rank}.json").read_text())


def family_runs(root: Path, families: tuple[str, ...]) -> str:
    """rank_script's `--runs`: each family with full fine-tuning and with LoRA, into `root/<family>-<lora rank>`."""
    jobs = [
        {"model": str(build_family(f)), "out": str(root / f"{f}-{rank}"), "lora_rank": rank}
        for f in families
        for rank in (0, FAMILY_LORA_RANK)
    ]
    return json.dumps(jobs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two steps on one rank and on two, each checkpointed after its first step; and the CI families' two steps on
    two ranks (under `families`)."""
    root = tmp_path_factory.mktemp("ranks")
    model = str(tied_tiny(root / "model"))
    paths = {"model": Path(model), "root": root, "families": root / "families"}
    paths["one"], paths["two"] = root / "one", root / "two"
    one_rank("--model", model, "--out", str(root / "one"), "--steps", "2", "--save", str(root / "one-ckpt"))
    # the 2-rank group then resumes the 1-rank checkpoint itself, and trains the families: one torchrun start
    two_ranks(
        *("--model", model, "--out", str(root / "two"), "--steps", "2", "--save", str(root / "two-ckpt")),
        *("--then-load", str(root / "one-ckpt"), "--then-out", str(root / "one-to-two")),
        *("--runs", family_runs(paths["families"], CI_FAMILIES)),
    )
    return paths


@pytest.fixture(scope="module")
def scenario_families(tmp_path_factory) -> Path:
    """The other families' two steps on two ranks: one torchrun start for the six."""
    root = tmp_path_factory.mktemp("families")
    two_ranks("--runs", family_runs(root, tuple(f for f in FAMILIES if f not in CI_FAMILIES)), "--steps", "2")
    return root


def test_two_ranks_take_the_update_one_process_takes(runs):
    one, two = runs["one"], runs["two"]
    assert facts(one)["world"] == 1 and facts(two)["world"] == 2
    for step in ("step-1", "step-2"):
        assert max_difference(weights(one / step), weights(two / step)) <= TOLERANCE, step
    assert weights(one / "step-1").keys() == weights(runs["model"]).keys()  # the tied lm_head is not written twice
    before = weights(runs["model"])
    assert max_difference(before, weights(two / "step-1")) > 100 * TOLERANCE  # the step moved: the check can fail
    losses_one, losses_two = facts(one)["losses"], facts(two)["losses"]
    assert losses_one == pytest.approx(losses_two, rel=1e-4, abs=1e-7)


def test_tied_weights_stay_tied_and_each_of_two_ranks_holds_about_half(runs):
    one, two = runs["one"], runs["two"]
    assert facts(one)["tied"] and facts(two)["tied"]
    whole = facts(one)["local_bytes"]
    for rank in (0, 1):
        assert facts(two, rank)["local_bytes"] <= 0.55 * whole, rank


def test_a_checkpoint_of_two_ranks_resumes_on_one_and_one_of_one_on_two(runs):
    root, model = runs["root"], str(runs["model"])
    one_rank("--model", model, "--out", str(root / "two-to-one"), "--load", str(root / "two-ckpt"))
    for resumed, original in (("two-to-one", "two"), ("one-to-two", "one")):
        # the weights come back exactly; the next step (AdamW's moments came back too) is the one the original took
        assert max_difference(weights(root / resumed / "loaded"), weights(root / original / "step-1")) == 0.0
        assert max_difference(weights(root / resumed / "step-1"), weights(root / original / "step-2")) <= TOLERANCE


@pytest.mark.scenario  # a torchrun group more (a minute of CPU): the LoRA loop of CONTRIBUTING.md runs it
def test_a_lora_adapter_on_two_ranks_takes_the_update_of_one_and_its_checkpoint_moves_between_them(runs):
    """The base sharded and frozen, the adapter replicated with its gradients all-reduced: the merged weights of
    each step are one process's; the adapter-only checkpoint of two ranks resumes on one."""
    root, model = runs["root"], str(runs["model"])
    lora = ("--model", model, "--steps", "2", "--lora-rank", "4")
    one_rank(*lora, "--out", str(root / "lora-one"))
    two_ranks(*lora, "--out", str(root / "lora-two"), "--save", str(root / "lora-ckpt"))
    for step in ("step-1", "step-2"):
        assert max_difference(weights(root / "lora-one" / step), weights(root / "lora-two" / step)) <= TOLERANCE
    assert max_difference(weights(runs["model"]), weights(root / "lora-two" / "step-1")) > 100 * TOLERANCE
    one_rank("--model", model, "--lora-rank", "4", "--out", str(root / "lora-back"), "--load", str(root / "lora-ckpt"))
    assert max_difference(weights(root / "lora-back" / "loaded"), weights(root / "lora-two" / "step-1")) == 0.0
    assert max_difference(weights(root / "lora-back" / "step-1"), weights(root / "lora-two" / "step-2")) <= TOLERANCE


def initial(model: str) -> dict[str, torch.Tensor]:
    """A model's weights under the names the trainer writes them (transformers 5 keeps a MoE's experts fused in
    memory and stores them per expert)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("lora_rank", [0, FAMILY_LORA_RANK], ids=["full", "lora"])
@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=() if f in CI_FAMILIES else pytest.mark.scenario) for f in FAMILIES]
)
def test_each_family_on_two_ranks_takes_the_update_one_process_takes(family, lora_rank, runs, request, tmp_path):
    """Full fine-tuning and LoRA (the base sharded and frozen, the adapter replicated): the weights after each of
    two steps (a LoRA run's merged into the base) are one process's."""
    root = runs["families"] if family in CI_FAMILIES else request.getfixturevalue("scenario_families")
    two = root / f"{family}-{lora_rank}"
    model = str(build_family(family))
    one_rank("--model", model, "--out", str(tmp_path), "--steps", "2", "--lora-rank", str(lora_rank))
    assert facts(tmp_path)["world"] == 1 and facts(two)["world"] == 2
    for step in ("step-1", "step-2"):
        assert max_difference(weights(tmp_path / step), weights(two / step)) <= TOLERANCE, step
    assert max_difference(initial(model), weights(two / "step-1")) > 100 * TOLERANCE  # it moved: the check can fail
    assert facts(tmp_path)["losses"] == pytest.approx(facts(two)["losses"], rel=1e-4, abs=1e-7)
