"""The README's settings table is the whole of ``mgserve serve``'s options (issue 15): every flag
the CLI defines, with its ``MGSERVE_<NAME>`` variable, and no row for a flag that is gone."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from mgserve.cli import _parser
from mgserve.config import Settings, env_name

ROOT = Path(__file__).resolve().parent.parent


def _table() -> list[tuple[str, str]]:
    """(flag cell, variable cell) per row of the README's settings table."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    return [(cells[0], cells[1]) for cells in (r.split(" | ") for r in rows) if len(cells) > 2]


def _serve_options() -> set[str]:
    serve = _parser(serve_only=True)._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return {o for a in serve._actions for o in a.option_strings if o not in ("-h", "--help")}


def test_every_flag_of_mgserve_serve_is_in_the_readme_settings_table() -> None:
    flags = {f for cell, _ in _table() for f in re.findall(r"(?<![\w-])(--?[\w-]+)", cell)}
    missing = _serve_options() - flags
    assert not missing, f"the README's settings table lacks: {sorted(missing)}"
    gone = flags - _serve_options()
    assert not gone, f"the README's settings table lists flags serve does not have: {sorted(gone)}"


def test_every_setting_s_variable_is_in_the_readme_settings_table() -> None:
    names = {v for _, cell in _table() for v in re.findall(r"MGSERVE_\w+", cell)}
    expected = {env_name(f.name) for f in dataclasses.fields(Settings)}
    assert names == expected, names ^ expected
