"""The Flower ServerApp of fedprivacy and its strategy (glue around fedprivacy.results)."""

import fedprivacy  # noqa: F401  # first: its OpenMP setting must be in place before PyTorch loads
