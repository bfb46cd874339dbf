"""The Flower ClientApp of fedprivacy (glue; the client's logic is fedprivacy.participant)."""

import fedprivacy  # noqa: F401  # first: its OpenMP setting must be in place before PyTorch loads
