"""Any comma-separated file: the user names the label column, and optionally features and clients."""

from fedprivacy.data.loaders import load_csv
from fedprivacy.data.registry import Source

SOURCE = Source(
    name="csv",
    summary="any CSV file: a label column and its declared number of classes, numeric feature columns, "
    "an optional client column",
    loader=load_csv,
    reads="file",
    path_help="a CSV file",
    option_help={
        "label": "the label column (required): integers from 0",
        "features": "the feature columns (default: every column of the header but the label and client columns)",
        "client_column": "each row's natural client",
        "num_classes": "the number of classes (required): labels lie in [0, num_classes)",
        "per_row": "a deployed node's file (features declared): each line read alone, a bad row left out alone",
    },
    run_keys={"label": "label-column", "features": "feature-columns", "num_classes": "num-classes"},
    client_option="client_column",
    deployable=True,
)
