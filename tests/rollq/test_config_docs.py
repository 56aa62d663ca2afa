"""docs/config.md and the README's command table are the settings Structs rendered: they may not drift."""

from rollq.cli import COMMANDS, command_fields
from rollq.config_docs import CONFIG_MD, README, main, render_config_md, render_readme_block


def test_the_committed_reference_and_readme_table_are_up_to_date(capsys):
    assert main(["--check"]) == 0, capsys.readouterr().err


def test_every_setting_is_documented_with_its_flag_and_variable():
    text = render_config_md()
    table = render_readme_block()
    for command in COMMANDS:
        assert f"## `rollq {command.name}`" in text and f"`rollq {command.name}" in table
        for section, field in command_fields(command):
            assert f"`{field.env(section.name)}`" in text, (command.name, field.name)
            assert field.doc.split("(")[0].strip().replace("|", "\\|") in text
            if not field.shared:
                assert field.flag in table or field.positional


def test_check_fails_when_the_page_drifts(tmp_path, monkeypatch):
    import rollq.config_docs as config_docs

    stale = tmp_path / "config.md"
    stale.write_text(CONFIG_MD.read_text().replace("jobs run at once", "jobs run at twice"))
    monkeypatch.setattr(config_docs, "CONFIG_MD", stale)
    assert main(["--check"]) == 1
    assert README.exists()
