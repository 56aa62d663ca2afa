"""Decoded samples in the run directory (RUN_DIR/samples.jsonl): a tiny-model run against a real stack writes, at
its cadence, samples whose text is the trained model's tokenizer's decoding of the very token ids the workers
published (as an independent auditor read them); the progress output says where the file is, once; a resumed run
appends and writes no step twice."""

from __future__ import annotations

import io

import msgspec
import pytest
from transformers import AutoTokenizer

from rollq.engine.models import model_dir
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.trainer import samples
from rollq.trainer.loop import Trainer
from rollq.trainer.samples import SampleRecord
from tests.trainer.helpers import WORKFLOW_KWARGS

GROUP, GROUPS = 2, 2


async def train(cfg, redis, engines: list[str]) -> tuple[list, str]:
    progress = io.StringIO()
    pool = EnginePool(PoolConfig(urls=engines))
    try:
        records = await Trainer(cfg, redis, pool, progress=progress).run()
    finally:
        await pool.close()
    return records, progress.getvalue()


@pytest.mark.slow
async def test_a_run_writes_decoded_samples_of_the_ids_it_trained_at_its_cadence_and_a_resume_appends(
    redis, run_name, tmp_path, make_train_config, stack, auditor
):
    engines = await stack(run_name, engines=1, workers=1, concurrency=8)
    audit = await auditor(run_name)
    settings = dict(
        engine=engines,
        group_size=GROUP,
        groups_per_step=GROUPS,
        workflow_kwargs={**WORKFLOW_KWARGS, "max_new_tokens": 8},
        samples_every=2,
        samples_per_step=3,
    )
    records, progress = await train(make_train_config(steps=3, **settings), redis, engines)
    path = tmp_path / "run" / samples.SAMPLES_FILE
    lines = samples.read(path)
    # the first step and every 2nd: 3 samples each, taken round robin (a sample of each group first)
    assert [r.step for r in lines] == [1, 1, 1, 2, 2, 2]
    for step in (1, 2):
        trained = records[step - 1].groups
        got = [(r.group, r.sample_index) for r in lines if r.step == step]
        assert [g for g, _ in got] == [trained[0], trained[1], trained[0]] and got[0] != got[2]
    # said once, with the path, among the step lines
    said = [line for line in progress.splitlines() if str(path) in line]
    assert said == [samples.notice(path, 2, 3)] and progress.index("step    1/3") < progress.index(said[0])

    tokenizer = AutoTokenizer.from_pretrained(model_dir("tiny"))
    for r in lines:
        [t] = [t for t in audit.seen[r.group] if t.sample_index == r.sample_index]
        seq = t.sequences[r.sequence]
        ids, mask = list(seq.input_ids), list(seq.loss_mask)
        cut = mask.index(1)
        assert r.prompt == tokenizer.decode(ids[:cut]) and r.completion == tokenizer.decode(ids[cut:])
        assert r.prompt_tokens == cut and r.completion_tokens == len(ids) - cut > 0
        assert "Write a number using digits only." in r.prompt  # text a person reads, chat markers and all
        assert r.reward == seq.reward and r.version == r.step - 1
        assert r.versions == sorted({int(v) for v, m in zip(seq.versions, mask, strict=True) if m})

    # A life that crashed after writing step 4's samples and before its checkpoint: the resumed run cuts them and
    # writes step 4 once, after the first three steps' lines, which stay as they were.
    torn = SampleRecord(**{**msgspec.structs.asdict(lines[0]), "step": 4, "completion": "from a crashed life"})
    with path.open("ab") as f:
        f.write(msgspec.json.encode(torn) + b"\n")
    await train(make_train_config(steps=4, **settings), redis, engines)
    resumed = samples.read(path)
    assert resumed[: len(lines)] == lines
    assert [r.step for r in resumed[len(lines) :]] == [4, 4, 4]
    assert "from a crashed life" not in path.read_text()


def test_no_samples_when_turned_off(tmp_path):
    log = samples.SampleLog(tmp_path, every=0, per_step=4, tokenizer=lambda: None)
    assert not any(log.due(step) for step in range(1, 50))
    log = samples.SampleLog(tmp_path, every=5, per_step=0, tokenizer=lambda: None)
    assert not any(log.due(step) for step in range(1, 50))
    log = samples.SampleLog(tmp_path, every=5, per_step=2, tokenizer=lambda: None)
    assert [step for step in range(1, 21) if log.due(step)] == [1, 5, 10, 15, 20]
