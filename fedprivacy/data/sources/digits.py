"""scikit-learn's bundled 8x8 digits: the embedded default, runs anywhere with no file."""

from fedprivacy.data.loaders import load_digits
from fedprivacy.data.registry import Source

SOURCE = Source(
    name="digits",
    summary="scikit-learn's bundled 8×8 digits: 1,797 images in [0, 1], 10 classes; no file, no download",
    loader=load_digits,
    reads=None,
    path_help="nothing (built in)",
    option_help={"images": "[n, 1, 8, 8] images instead of rows of 64 pixels"},
)
