"""The reference pages generated from the code are the ones checked in."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cli_reference_is_current():
    """docs/cli.md is what scripts/cli_reference.py makes of today's parsers."""
    spec = importlib.util.spec_from_file_location(
        "cli_reference", ROOT / "scripts" / "cli_reference.py"
    )
    cli_reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli_reference)
    text = cli_reference.reference()
    assert "`--expert-memory EXPERT_MEMORY`" in text and "## `expertstream serve`" in text
    assert (ROOT / "docs" / "cli.md").read_text() == text, (
        "docs/cli.md is stale: run python scripts/cli_reference.py and commit it"
    )
