"""The run-config table of docs/flower.md, rendered from `RUN_KEYS` so that the docs cannot drift.

After changing a declaration in fedprivacy/runconfig_keys.py, regenerate the table with
`python -m fedprivacy.runconfig_docs docs/flower.md` (tests/test_runconfig_keys.py fails until then).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from fedprivacy.generated_docs import between_markers, cell
from fedprivacy.runconfig_keys import GROUPS, RUN_KEYS

REGENERATE = "python -m fedprivacy.runconfig_docs docs/flower.md"
BEGIN = f"<!-- run-config table: generated from fedprivacy/runconfig_keys.py by `{REGENERATE}` -->"
END = "<!-- end of run-config table -->"


def default_text(value: bool | int | float | str) -> str:
    """A default as pyproject.toml spells it: strings quoted (as code), 1e-05 as 1e-5."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'`"{value}"`'
    return re.sub(r"e([+-])0*(\d)", r"e\1\2", repr(value))


def docs_table() -> str:
    """The markdown table: key, default, meaning; one bold row per group, then its keys."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for group in GROUPS:
        lines.append(f"| **{group}** | | |")
        lines += [
            f"| `{key.name}` | {default_text(key.default)} | {cell(key.help)} |"
            for key in RUN_KEYS
            if key.group == group
        ]
    return "\n".join(lines)


def with_table(text: str) -> str:
    """`text` (docs/flower.md) with the lines between its BEGIN and END markers replaced by the table."""
    return between_markers(text, BEGIN, END, docs_table(), "run-config table")


def main(argv: list[str]) -> None:
    """Rewrite the table in the markdown file named by `argv` (docs/flower.md)."""
    if len(argv) != 1:
        raise SystemExit(f"usage: {REGENERATE}")
    path = Path(argv[0])
    path.write_text(with_table(path.read_text(encoding="utf-8")), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
