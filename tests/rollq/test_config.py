"""rollq.config: typed settings checked on construction, and the file < environment < given layering."""

import msgspec
import pytest

from rollq.config import ConfigError, check_document, fields_of, load, overrides, read_document, section_values
from rollq.engine.server.config import EngineConfig
from rollq.producer.config import EnqueueConfig
from rollq.workers.config import WorkerConfig


def test_read_document_reads_a_mapping_and_rejects_anything_else(tmp_path):
    assert read_document(None) == {}
    (tmp_path / "empty.yaml").write_text("")
    assert read_document(tmp_path / "empty.yaml") == {}
    (tmp_path / "ok.yaml").write_text("run: r1\nworker:\n  concurrency: 8\n")
    assert read_document(tmp_path / "ok.yaml") == {"run": "r1", "worker": {"concurrency": 8}}
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        read_document(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("worker: [1, 2\n")
    with pytest.raises(ConfigError, match="cannot read config"):
        read_document(tmp_path / "broken.yaml")
    with pytest.raises(ConfigError, match="cannot read config"):
        read_document(tmp_path / "missing.yaml")


def test_check_document_names_unknown_keys_and_non_mapping_sections():
    check_document({"redis_url": "redis://x", "run": "r", "worker": {}}, ["worker", "engine"])
    with pytest.raises(ConfigError, match="unknown config key.*wokrer"):
        check_document({"wokrer": {}}, ["worker"])
    with pytest.raises(ConfigError, match="'worker' must be a mapping"):
        check_document({"worker": 3}, ["worker"])


def test_constraints_are_checked_however_the_settings_are_built():
    with pytest.raises(ValueError, match=r"concurrency: expected `int` >= 1"):
        WorkerConfig(concurrency=0)
    with pytest.raises(ValueError, match=r"run: expected `str` matching"):
        WorkerConfig(run="bad name")
    with pytest.raises(ValueError, match="lease_refresh_ms must be well below lease_ms"):
        WorkerConfig(lease_ms=1000, lease_refresh_ms=900)
    with pytest.raises(msgspec.ValidationError, match=r"Expected `int` >= 1 - at `\$.concurrency`"):
        msgspec.convert({"concurrency": 0}, WorkerConfig)
    assert WorkerConfig(lease_ms=600).lease_refresh_ms == 100  # derived defaults still apply


def test_section_values_layer_the_environment_over_the_file():
    doc = {"redis_url": "redis://file:6379/0", "run": "from-file", "worker": {"concurrency": 8, "name": "w"}}
    env = {
        "ROLLQ_WORKER_CONCURRENCY": "32",
        "ROLLQ_WORKER_ENGINE": "[http://a, http://b]",
        "ROLLQ_WORKER_NAME": "007",
        "ROLLQ_ENGINE_BACKEND": "reference",
        "ROLLQ_RUN": "from-env",
        "ROLLQ_CACHE": "/tmp/x",
    }
    got = section_values(WorkerConfig, "worker", doc, env)
    assert got == {
        "redis_url": "redis://file:6379/0",
        "run": "from-env",
        "concurrency": 32,
        "name": "007",
        "engine": ["http://a", "http://b"],
    }  # YAML-typed, except text settings, taken as they are


def test_unknown_keys_from_the_file_and_the_environment_are_refused():
    with pytest.raises(ConfigError, match="unknown setting.*concurency in section 'worker'.*known: .*concurrency"):
        section_values(WorkerConfig, "worker", {"worker": {"concurency": 8}}, {})
    with pytest.raises(ConfigError, match="ROLLQ_WORKER_CONCURENCY names no setting of 'worker'"):
        section_values(WorkerConfig, "worker", {}, {"ROLLQ_WORKER_CONCURENCY": "8"})
    with pytest.raises(ConfigError, match="unknown setting.*redis_url"):  # a shared key belongs at the top level
        section_values(WorkerConfig, "worker", {"worker": {"redis_url": "redis://x"}}, {})


def test_load_layers_file_environment_and_given_values(tmp_path):
    path = tmp_path / "rollq.yaml"
    path.write_text("engine: {backend: reference, port: 31000, register: true}\n")
    cfg = load(EngineConfig, "engine", path, env={"ROLLQ_ENGINE_PORT": "32000"}, given={"seed": 3})
    assert (cfg.backend, cfg.port, cfg.register, cfg.seed) == ("reference", 32000, True, 3)
    with pytest.raises(ConfigError, match=r"section 'engine': backend: invalid enum value 'gpu'"):
        load(EngineConfig, "engine", None, env={"ROLLQ_ENGINE_BACKEND": "gpu"})
    with pytest.raises(
        ConfigError,
        match="workflow is required: give --workflow, `workflow:` in section 'enqueue' or ROLLQ_ENQUEUE_WORKFLOW",
    ):
        load(EnqueueConfig, "enqueue", None, env={}, given={"file": "jobs.jsonl"})


def test_key_value_overrides_name_a_setting():
    assert overrides(WorkerConfig, ["concurrency=3", "name=42"]) == {"concurrency": 3, "name": "42"}
    with pytest.raises(ConfigError, match="KEY one of"):
        overrides(WorkerConfig, ["concurency=3"])
    with pytest.raises(ConfigError, match="KEY one of"):
        overrides(WorkerConfig, ["redis_url=redis://x"])  # shared: --redis / the file's top level


def test_every_setting_has_a_doc():
    from rollq.cli import COMMANDS

    for command in COMMANDS:
        for section in command.sections:
            for field in fields_of(section.settings):
                assert field.doc, f"{section.name}.{field.name} has no doc"
