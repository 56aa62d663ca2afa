"""The shared config document: file, environment and section rules."""

import pytest

from protocol.config import ConfigError, check_document, read_document, section_settings, shared_value


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


def test_section_settings_layers_the_environment_over_the_file():
    doc = {"worker": {"concurrency": 8, "name": "w"}}
    env = {"ROLLQ_WORKER_CONCURRENCY": "32", "ROLLQ_WORKER_ENGINE": "[http://a, http://b]",
           "ROLLQ_ENGINE_BACKEND": "reference", "ROLLQ_REDIS_URL": "redis://elsewhere", "ROLLQ_CACHE": "/tmp/x"}
    got = section_settings(doc, "worker", {"concurrency", "name", "engine"}, env)
    assert got == {"concurrency": 32, "name": "w", "engine": ["http://a", "http://b"]}  # typed by YAML


def test_section_settings_rejects_unknown_keys_from_file_and_environment():
    with pytest.raises(ConfigError, match="unknown setting.*concurency.*known: concurrency"):
        section_settings({"worker": {"concurency": 8}}, "worker", {"concurrency"}, {})
    with pytest.raises(ConfigError, match="ROLLQ_WORKER_CONCURENCY names no setting"):
        section_settings({}, "worker", {"concurrency"}, {"ROLLQ_WORKER_CONCURENCY": "8"})


def test_shared_values_come_from_the_environment_before_the_file():
    doc = {"redis_url": "redis://file:6379/0", "run": "from-file"}
    assert shared_value("run", doc, {}) == "from-file"
    assert shared_value("run", doc, {"ROLLQ_RUN": "from-env"}) == "from-env"
    assert shared_value("redis_url", {}, {}) is None
