"""A validation split carved from the clients' training rows, for honest hyperparameter choice.

`training_rows_file` writes the raw rows of every client's TRAINING split (the rows the private
clients train on; never a test row) to a new CSV of the same layout. A run config pointing
`data-path` at that file makes every client split its training rows again, by the same seeded
rule, into a smaller training part and a validation part; the server then evaluates on the union
of the validation parts. The test set the reported numbers use is never read.

The rows are cut by the run config's data seed (`split-seed`, or `seed` when it is -1), as every
run cuts them. New tuning should use a sweep's `[tune]` instead (validation rows cut inside each
run, docs/simulator.md#tuning-per-cell); this file reproduces the earlier searches of
scenarios/pums_tuning*.toml, whose validation rows the built-in split does not cut the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedprivacy.catalog import FILE_DATASETS
from fedprivacy.data.loaders import load_dataset
from fedprivacy.data.partition import load_clients, partition_rows
from fedprivacy.data.splits import split_indices
from fedprivacy.recipe import partition_kwargs
from fedprivacy.runconfig import DEFAULTS, parse_run_config
from sims.runner import natural_client_count


def training_rows_file(run_config: dict[str, Any], out: Path) -> Path:
    """Write the training rows of `run_config`'s clients (pums or csv, natural partitions) to `out`."""
    config = {**DEFAULTS, **run_config}
    settings = parse_run_config(config)
    kwargs = partition_kwargs(settings, natural_client_count(config))
    if settings.dataset not in FILE_DATASETS or kwargs["scheme"] != "natural" or settings.data_path is None:
        raise ValueError("a validation file needs a pums or csv data set with natural partitions (partition-by)")
    options = {
        k: v
        for k, v in kwargs.items()
        if k not in ("name", "path", "scheme", "num_partitions", "seed", "by", "alpha", "skew", "test_fraction")
    }
    if kwargs["by"] is not None:
        options["client_column"] = kwargs["by"]
    dataset = load_dataset(settings.dataset, settings.data_path, **options)
    seed = settings.data_seed  # the partitions' and splits' seed, as in fedprivacy.data.partition
    parts = partition_rows(dataset, "natural", kwargs["num_partitions"], seed, kwargs["by"])
    table = pd.read_csv(settings.data_path)
    if len(table) != len(dataset):
        raise ValueError(f"{settings.data_path}: {len(table)} rows in the file, {len(dataset)} loaded")
    keep = []
    for position, (_, rows) in enumerate(parts):  # the same split as fedprivacy.data.partition._client
        train, _ = split_indices(dataset.labels[rows], settings.test_fraction, np.random.default_rng([seed, position]))
        keep.append(rows[train])
    rows = np.sort(np.concatenate(keep))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.iloc[rows].to_csv(out, index=False)
    # Check: the file holds exactly each client's training rows, nothing of any test split.
    originals = load_clients(**kwargs)
    carved = load_dataset(settings.dataset, out, **options)
    for client, (_, part) in zip(
        originals, partition_rows(carved, "natural", len(originals), seed, kwargs["by"]), strict=True
    ):
        mine = np.sort(carved.features[part].sum(axis=1))
        theirs = np.sort(client.train.features.sum(axis=1))
        if mine.shape != theirs.shape or not np.allclose(mine, theirs):
            raise AssertionError(f"client {client.client_id}: validation file does not match its training rows")
    return out


def main() -> None:
    """`python -m sims.validation --data FILE --partition-by COLUMN --out FILE`: write the validation file."""
    import argparse

    parser = argparse.ArgumentParser(
        description="Write the clients' training rows (never a test row) to a CSV for tuning."
    )
    parser.add_argument("--data", type=Path, required=True, help="the full data file (pums or csv layout)")
    parser.add_argument("--dataset", default="pums", choices=FILE_DATASETS)
    parser.add_argument("--partition-by", required=True, help="the client column (natural partitions)")
    parser.add_argument("--label-column", default="", help="csv only: the label column")
    parser.add_argument("--num-classes", type=int, default=0, help="csv only: the number of classes (required)")
    parser.add_argument(
        "--feature-columns", default="", help="csv only: comma-separated (default: the header's others)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the run config's seed (the split's, without --split-seed)")
    parser.add_argument(
        "--split-seed", type=int, default=-1, help="the run config's split-seed (-1: the seed decides the split)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = {
        "dataset": args.dataset,
        "data-path": str(args.data.resolve()),
        "partition-by": args.partition_by,
        "label-column": args.label_column,
        "num-classes": args.num_classes,
        "feature-columns": args.feature_columns,
        "seed": args.seed,
        "split-seed": args.split_seed,
    }
    print(training_rows_file(config, args.out))


if __name__ == "__main__":
    main()
