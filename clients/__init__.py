"""The Flower ClientApp of fedprivacy: glue around the library's client modules."""

import fedprivacy  # noqa: F401  # first: its OpenMP setting must be in place before PyTorch loads
