"""bench/report.py renders docs/benchmarks.md and the README's headline from the results files the benchmarks write
(bench/results/*.json): deterministically, every table with its provenance, and `--check` fails CI when the committed
page or README block is not what the committed results files render. No benchmark runs here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from bench import report
from bench.results import RESULTS_DIR, results_record, write_results


def _record(bench: str, summary: dict[str, Any], **over: Any) -> dict[str, Any]:
    rec = results_record(bench, summary, ["--repeat", "3"])
    rec.update(
        command=f"python -m bench.{bench} --repeat 3",
        date="2026-01-02T03:04:05Z",
        commit="0123456789abcdef0123456789abcdef01234567",
        dirty=False,
        duration_s=12.5,
        machine={"cpu": "Test CPU", "cpus": 2, "memory_gib": 8.0, "gpus": [], "python": "3.11.0", "torch": "2.0"},
        load_avg={"start": [0.5, 0.4, 0.3], "end": [1.5, 1.0, 0.5]},
        **over,
    )
    return rec


QUEUE: dict[str, Any] = {
    "rollq_traj_per_s": 4321.0,
    "arq_traj_per_s": 400.0,
    "rollq_vs_arq": 10.8,
    "rollq_vs_asyncio_queue": 0.4,
    "targets": {"rollq_traj_per_s>=3000": True, "rollq_vs_arq>=10": False},
    "systems": {
        "rollq": {"jobs": 20000, "seconds": 4.6, "traj_per_s": 4321.0, "cpu_us_per_traj": {"worker": 180.0}},
        "arq": {"jobs": 2000, "seconds": 5.0, "traj_per_s": 400.0},
        "asyncio.Queue": None,
    },
    "encodings": {"rollq_codec_packed": {"1024": {"bytes": 13603, "encode_us": 3.5, "decode_us": 8.2}}},
}


def _folder(tmp_path: Path, **records: dict[str, Any]) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    for name, rec in records.items():
        (folder / f"{name}.json").write_text(json.dumps(rec))
    return folder


def test_a_results_folder_renders_its_tables_with_their_provenance(tmp_path: Path) -> None:
    results = report.load_results(_folder(tmp_path, queue_throughput=_record("queue_throughput", QUEUE)))
    page = report.render_page(results)
    assert page == report.render_page(results)  # deterministic
    assert "| rollq | 20,000 | 4.60 | 4,321 |" in page
    assert "| asyncio.Queue |" not in page  # a system skipped in the run has no row
    assert "| rollq_codec_packed | 13,603 | 3.5 | 8.2 | — | — | — |" in page  # a length not measured
    # each table states its command, date, commit and machine
    prov = page.count(
        "*Measured by `python -m bench.queue_throughput --repeat 3`, 2026-01-02 03:04 UTC, commit `0123456789`; "
        "2 x Test CPU, 8.0 GiB, no GPU; load average 0.50 / 0.40 / 0.30 (1 / 5 / 15 min) at the start.*"
    )
    assert prov == 2
    assert "`rollq_vs_arq>=10` **missed**" in page
    # a bench without a results file says so, the GPU-only one with its reason; no old figures
    assert "## Asynchronous vs synchronous RL" in page and "*not run: no results file yet*" in page
    assert "*not run here: it needs a CUDA GPU" in page
    assert "Engine: continuous batching (standalone)" not in page  # optional parts appear only with their file

    headline = report.render_headline(results)
    assert "| 4,321/s, 10.8x arq | >= 3,000/s, >= 10x arq |" in headline
    assert "](docs/benchmarks.md#queue-throughput-rollq-vs-arq-vs-asyncioqueue)" in headline
    assert "| not run |" in headline  # async_rl, agents: no files


def test_a_results_file_without_a_spec_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no table spec"):
        report.load_results(_folder(tmp_path, mystery=_record("mystery", {})))


def test_write_results_records_the_command_and_the_machine(tmp_path: Path) -> None:
    path = write_results("staleness_model", {"rows": []}, str(tmp_path), ["--eta", "2"])
    assert path is not None
    rec = json.loads(path.read_text())
    assert rec["command"].endswith("--eta 2") and rec["summary"] == {"rows": []}
    assert rec["machine"]["cpus"] and rec["machine"]["python"] and "start" in rec["load_avg"]
    assert rec["commit"] is None or (len(rec["commit"]) == 40 and isinstance(rec["dirty"], bool))  # None: no git
    assert write_results("staleness_model", {}, "", []) is None  # --results '': nothing written


def test_every_committed_results_file_has_a_spec_and_the_committed_page_and_readme_are_current() -> None:
    problems = report.check()
    assert not problems, "\n".join(problems)


def test_check_fails_on_a_changed_figure_page_or_readme_block(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS_DIR, results)
    page, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    shutil.copy(report.PAGE, page)
    shutil.copy(report.README, readme)
    assert report.check(results, page, readme) == []

    any_file = sorted(results.glob("*.json"))[0]
    rec = json.loads(any_file.read_text())
    rec["date"] = "1999-01-01T00:00:00Z"  # every table states its date: any change shows
    any_file.write_text(json.dumps(rec))
    assert any("benchmarks.md differs" in p for p in report.check(results, page, readme))
    assert report.main(["--check", "--results", str(results), "--page", str(page), "--readme", str(readme)]) == 1
    assert report.main(["--results", str(results), "--page", str(page), "--readme", str(readme)]) == 0
    assert report.check(results, page, readme) == []  # rewritten: current again

    page.write_text(page.read_text().replace("| 2 x ", "| 3 x ", 1))
    assert report.check(results, page, readme)
    shutil.copy(report.PAGE, page)
    report.main(["--results", str(results), "--page", str(page), "--readme", str(readme)])
    text = readme.read_text()
    start = text.index(report.START) + len(report.START)
    readme.write_text(text[:start] + "\n| hand-typed | 9.99x | |" + text[start:])
    assert any("headline differs" in p for p in report.check(results, page, readme))
    readme.write_text(text.replace(report.START, ""))
    assert any("no <!-- bench:headline:start -->" in p for p in report.check(results, page, readme))
