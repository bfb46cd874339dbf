"""Any comma-separated file: the user names the label column, and optionally features and clients."""

from fedprivacy.data.loaders import load_csv
from fedprivacy.data.registry import Source

SOURCE = Source(
    name="csv",
    summary="any CSV file: a label column, numeric feature columns, an optional client column",
    loader=load_csv,
    reads="file",
    path_help="a CSV file",
    option_help={
        "label": "the label column (required): integers from 0",
        "features": "the feature columns (default: every other numeric column)",
        "client_column": "each row's natural client",
        "num_classes": "declared classes (a deployed node): a row with a bad cell or label is then dropped alone",
    },
    run_keys={"label": "label-column"},
    client_option="client_column",
    deployable=True,
)
