"""Logistic data with a known optimum, for scale and convergence tests with no file."""

from fedprivacy.data.loaders import load_synthetic
from fedprivacy.data.registry import Source

SOURCE = Source(
    name="synthetic",
    summary="logistic data with a known optimum: x ~ N(0, I), y ~ Bernoulli(sigmoid(x · w*)); no file",
    loader=load_synthetic,
    reads=None,
    path_help="nothing (built in)",
    option_help={
        "num_examples": "rows",
        "num_features": "features",
        "seed": "the data's own seed (w* and the rows), not the run's",
    },
    run_keys={"num_examples": "synthetic-examples", "num_features": "synthetic-features"},
)
