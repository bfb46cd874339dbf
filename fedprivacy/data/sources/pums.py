"""The census PUMS layout (the extract beside the repository): predict `employed`."""

from fedprivacy.data.loaders import load_pums
from fedprivacy.data.registry import Source

SOURCE = Source(
    name="pums",
    summary="the census PUMS layout: predict `employed` from 10 binary features (15 extended); natural clients by PUMA",
    loader=load_pums,
    reads="file",
    path_help="a CSV file",
    option_help={
        "extended": "add age, educ/16, latino, divorced and children to the 10 binary features",
        "client_column": "each row's natural client (None: none)",
        "age": "`linear` (age/100) or `bands` (one 0/1 feature per fixed age band)",
        "per_row": "a deployed node's file: each line read alone, a row with a bad cell left out alone",
    },
    run_keys={"age": "pums-age"},
    client_option="client_column",
    deployable=True,
)
