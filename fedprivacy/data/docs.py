"""The tables of docs/data.md (every source, every option), rendered from the registry so that the
page cannot drift from the code.

After adding a source or changing an option, regenerate them with
python -m fedprivacy.data.docs docs/data.md (tests/test_data_sources.py fails until then).
"""

from __future__ import annotations

import sys
from pathlib import Path

from fedprivacy.data.registry import sources
from fedprivacy.generated_docs import between_markers, cell

BEGIN = "<!-- data-source tables: generated from fedprivacy/data/sources/ by fedprivacy/data/docs.py -->"
END = "<!-- end of data-source tables -->"


def docs_table() -> str:
    """The markdown tables of docs/data.md (every source, then every option): a test keeps the page equal."""
    lines = ["| source | data-path names | what it is |", "| --- | --- | --- |"]
    lines += [f"| `{s.name}` | {s.path_help} | {cell(s.summary)} |" for s in sources().values()]
    lines += [
        "",
        "| source | option | type | default | run-config key | meaning |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for source in sources().values():
        for option in source.options:
            key = f"`{option.run_key}`" if option.run_key else ""
            cells = (source.name, option.name, option.type, repr(option.default))
            lines.append("| " + " | ".join(f"`{cell(c)}`" for c in cells) + f" | {key} | {cell(option.help)} |")
    return "\n".join(lines)


def with_tables(text: str) -> str:
    """`text` (docs/data.md) with the lines between its BEGIN and END markers replaced by the tables."""
    return between_markers(text, BEGIN, END, docs_table(), "data-source tables")


def main(argv: list[str]) -> None:
    """Rewrite the tables in the markdown file named by `argv` (docs/data.md)."""
    if len(argv) != 1:
        raise SystemExit("usage: python -m fedprivacy.data.docs docs/data.md")
    path = Path(argv[0])
    path.write_text(with_tables(path.read_text(encoding="utf-8")), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
