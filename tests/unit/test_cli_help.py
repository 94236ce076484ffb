"""The command line explains itself: help without reStructuredText markup, the config's
sections in ``train --help``, and ``config show`` listing each key's value, default and
choices (in this process: no Ray, no subprocess)."""

from pathlib import Path

import pytest

from raytrain_ext.cli import main
from raytrain_ext.config.show import sections

REPO = Path(__file__).resolve().parents[2]


def help_text(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_has_no_markup_and_train_help_lists_every_section(capsys):
    top = help_text(capsys, ["--help"])
    assert "``" not in top and "config" in top
    train = help_text(capsys, ["train", "--help"])
    assert "``" not in train
    for name, _ in sections():
        assert f"\n  {name} " in train, name
    assert "raytrain-ext config show [CONFIG.yaml] [SECTION ...] [key=value ...]" in train


def test_config_show_lists_values_defaults_and_choices(capsys, tmp_path):
    assert (
        main(
            [
                "config",
                "show",
                str(REPO / "configs" / "sft_llama_tiny.yaml"),
                "checkpoint",
                "objective",
                "checkpoint.every_seconds=30",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("# objective: How a batch")  # in the schema's order
    assert "\n# checkpoint: When and where checkpoints are written" in out
    lines = {line.split(":")[0]: line for line in out.splitlines() if not line.startswith("#")}
    assert lines["checkpoint.every_seconds"].split("#")[1].strip() == (
        "default 600.0; > 0 or null (disabled)"
    )
    assert lines["checkpoint.every_seconds"].startswith("checkpoint.every_seconds: 30.0 ")
    assert lines["objective.name"].startswith("objective.name: null ")  # follows data.format
    assert "one of causal_lm, sft, dpo, grpo, user" in lines["objective.name"]
    assert not any(key.startswith("data.") for key in lines)


def test_config_show_names_an_unknown_section(capsys):
    assert main(["config", "show", "chekpoint"]) == 2
    assert "unknown section 'chekpoint'; the sections are run, model, data" in (
        capsys.readouterr().err
    )
