"""What the docs' generated tables share: a table cell's escaping, and swapping the lines between a
file's BEGIN and END markers for the table (docs/flower.md's run-config keys, docs/data.md's data
sources), so that a test can compare the file with its freshly rendered self."""

from __future__ import annotations


def cell(text: str) -> str:
    """`text` inside a Markdown table cell: a '|' would end the cell."""
    return text.replace("|", "\\|")


def between_markers(text: str, begin: str, end: str, table: str, what: str) -> str:
    """`text` with the lines between its one `begin` line and its one `end` line replaced by `table`
    (blank lines around it keep the marker comments apart from the table); `what` names the table
    in the error raised when the markers are missing, repeated or out of order."""
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"the {what} needs one {begin!r} line and, after it, one {end!r} line")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n\n{table}\n\n{end}{tail}"
