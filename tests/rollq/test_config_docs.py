"""The generated reference pages (docs/config.md, docs/commands.md, docs/ingress-openapi.json) are the settings
Structs and the ingress's OpenAPI document rendered: they may not drift."""

import json

from rollq.cli import COMMANDS, command_fields
from rollq.config_docs import (
    COMMANDS_MD,
    CONFIG_MD,
    OPENAPI_JSON,
    main,
    render_commands_md,
    render_config_md,
    render_openapi_json,
)
from rollq.producer.ingress.models import openapi


def test_the_committed_pages_are_up_to_date(capsys):
    assert main(["--check"]) == 0, capsys.readouterr().err


def test_every_setting_is_documented_with_its_flag_and_variable():
    text = render_config_md()
    table = render_commands_md()
    for command in COMMANDS:
        assert f"## `rollq {command.name}`" in text and f"`rollq {command.name}" in table
        assert f"(config.md#rollq-{command.name})" in table
        for section, field in command_fields(command):
            assert f"`{field.env(section.name)}`" in text, (command.name, field.name)
            assert field.doc.split("(")[0].strip().replace("|", "\\|") in text
            if not field.shared:
                assert field.flag in table or field.positional


def test_the_openapi_copy_is_what_the_ingress_serves():
    assert json.loads(render_openapi_json()) == json.loads(json.dumps(openapi()))
    assert "/v1/jobs" in json.loads(OPENAPI_JSON.read_text())["paths"]


def test_check_fails_when_a_page_drifts(tmp_path, monkeypatch):
    import rollq.config_docs as config_docs

    for name, path in [("CONFIG_MD", CONFIG_MD), ("COMMANDS_MD", COMMANDS_MD), ("OPENAPI_JSON", OPENAPI_JSON)]:
        stale = tmp_path / path.name
        stale.write_text(path.read_text().replace("rollq", "rollx", 1))
        monkeypatch.setattr(config_docs, name, stale)
        assert main(["--check"]) == 1, name
        monkeypatch.setattr(config_docs, name, path)
    assert main(["--check"]) == 0
