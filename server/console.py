"""What the ServerApp tells the user, once per event.

`flwr run --stream` and `flwr log` show the ServerApp's stdout. The server's modules log through
`logging.getLogger(__name__)`; while a run lasts, `reporting()` prints their records on stdout as
`[fedprivacy] …` lines and keeps Flower's own log from repeating the round's evaluation, which
fedprivacy's round line already reports (with the privacy spent beside it).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from flwr.common.logger import FLOWER_LOGGER

SERVER_LOGGER = logging.getLogger("server")
# Flower's per-round evaluation lines (flwr.serverapp.Strategy.start), reported by our round line
_REPEATED_BY_OUR_ROUND_LINE = (
    "Initial global evaluation results: %s",
    "Global evaluation",
    "\t└──> MetricRecord: %s",
)


class _Stdout(logging.Handler):
    """Writes to whatever sys.stdout is at the time (flwr and tests capture it)."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stdout.write(self.format(record) + "\n")
        sys.stdout.flush()


class _OurRoundLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in _REPEATED_BY_OUR_ROUND_LINE


@contextmanager
def reporting() -> Iterator[None]:
    handler, quiet_repeats = _Stdout(), _OurRoundLine()
    handler.setFormatter(logging.Formatter("[fedprivacy] %(message)s"))
    level = SERVER_LOGGER.level
    SERVER_LOGGER.addHandler(handler)
    SERVER_LOGGER.setLevel(logging.INFO)
    FLOWER_LOGGER.addFilter(quiet_repeats)
    try:
        yield
    finally:
        FLOWER_LOGGER.removeFilter(quiet_repeats)
        SERVER_LOGGER.removeHandler(handler)
        SERVER_LOGGER.setLevel(level)
