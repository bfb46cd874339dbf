"""Each run-config key is declared once (fedprivacy/runconfig_keys.py): the settings, the docs table
and the CLI's choices follow that declaration, and the CLI starts without loading torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from fedprivacy.catalog import MODEL_NAMES, RULE_NAMES
from fedprivacy.errors import InputError
from fedprivacy.models import MODELS
from fedprivacy.runconfig import RunSettings, parse_run_config
from fedprivacy.runconfig_docs import REGENERATE, docs_table, with_table
from fedprivacy.runconfig_keys import RUN_KEYS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "flower.md"


def test_settings_have_one_field_per_declared_key_in_its_order():
    assert [f.name for f in dataclasses.fields(RunSettings)] == [key.field for key in RUN_KEYS]


def test_every_declared_default_passes_its_own_check():
    for key in RUN_KEYS:
        key.parse(key.name, key.default)


def test_docs_table_is_the_rendering_of_the_declarations():
    text = DOCS.read_text(encoding="utf-8")
    assert with_table(text) == text, f"docs/flower.md's run-config table is out of date: run `{REGENERATE}`"
    assert docs_table().count("\n| `") == len(RUN_KEYS)  # one row per key


def test_the_torch_free_model_names_are_the_registry():
    assert tuple(MODELS) == MODEL_NAMES


def test_the_catalog_rule_names_are_the_registry():
    from fedprivacy.privacy.rules import RULES

    assert tuple(RULES) == RULE_NAMES


@pytest.mark.parametrize(
    ("config", "key", "schedule"),
    [
        ({"lr-schedule": "constant", "lr-offset": 5.0}, "lr-offset", "constant"),
        ({"lr-schedule": "constant", "lr-decay": 0.5}, "lr-decay", "constant"),
        ({"lr-offset": 5.0}, "lr-offset", "constant"),  # the proactive rule's own schedule
        ({"rule": "calibrated", "lr-decay": 2.0}, "lr-decay", "constant"),
        ({"lr-schedule": "adagrad_norm", "lr-offset": 5.0}, "lr-offset", "adagrad_norm"),
        ({"rule": "adp", "lr-schedule": "adagrad_norm", "lr-decay": 0.0}, "lr-decay", "adagrad_norm"),
    ],
)
def test_inverse_sqrt_keys_are_refused_under_another_schedule(config, key, schedule):
    with pytest.raises(
        InputError, match=f"shapes only lr-schedule='inverse_sqrt'; this run's schedule is '{schedule}'"
    ):
        parse_run_config(config)
    with pytest.raises(InputError) as info:
        parse_run_config(config)
    assert info.value.field == key


@pytest.mark.parametrize(
    "config",
    [
        {"rule": "adp", "lr-offset": 5.0, "lr-decay": 0.5},  # adp's own schedule is inverse_sqrt
        {"lr-schedule": "inverse_sqrt", "lr-offset": 5.0},
        # their defaults, even under another schedule: Flower hands the apps every key of pyproject.toml,
        # so a default cannot be told from a key the user left alone
        {"lr-schedule": "constant", "lr-offset": 20.0, "lr-decay": 1},
    ],
)
def test_inverse_sqrt_keys_are_taken_under_their_schedule_or_at_their_defaults(config):
    parse_run_config(config)


def test_help_starts_without_torch_or_the_accountants():
    """The help lists names only: neither PyTorch nor dp-accounting (with scipy) should load for it."""
    probe = (
        "import sys\n"
        "from fedprivacy.cli import main\n"
        "sys.argv = ['fedprivacy', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'dp_accounting', 'scipy') if m in sys.modules]\n"
        "print(f'loaded: {heavy}' if heavy else 'none loaded')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert "sweep" in done.stdout  # the help was printed
    last = done.stdout.strip().splitlines()[-1]
    assert last == "none loaded", f"`fedprivacy --help` {last}: import them inside the command"


def test_a_generated_table_needs_its_markers_once_and_in_order():
    from fedprivacy.generated_docs import between_markers

    assert between_markers("a\n<b>\nold\n<e>\nz", "<b>", "<e>", "T", "table") == "a\n<b>\n\nT\n\n<e>\nz"
    for broken in ("no markers", "<e>\n<b>", "<b>\n<b>\n<e>", "<b>\n<e>\n<e>"):
        with pytest.raises(ValueError, match="the table needs one '<b>' line and, after it, one '<e>' line"):
            between_markers(broken, "<b>", "<e>", "T", "table")
