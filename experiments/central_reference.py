"""Non-private central references for federated PUMS: the union of the 7 PUMA clients' TRAINING
rows, pooled, fits scikit-learn's LogisticRegression and MLPClassifier (one hidden layer of 64,
the federated MLP's shape), scored on the union of the clients' TEST rows: the same rows the
federated runs train and test on, for each seed (the seed fixes every client's 80/20 split).

Nothing is tuned: scikit-learn's defaults (MLP: Adam, α = 1e-4, up to 500 iterations); the seed
also seeds the MLP. Prints mean ± sd over the seeds, writes JSON.

Usage: python experiments/central_reference.py [--data ../shared/data/pums/fulton_pums5_full.csv] [--seeds 0,1,2,3,4]
       [--pums-age linear|bands] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.neural_network import MLPClassifier

from fedprivacy.data.partition import load_clients
from fedprivacy.recipe import partition_kwargs
from fedprivacy.runconfig import DEFAULTS, parse_run_config


def pooled(data: Path, seed: int, age: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    settings = parse_run_config(
        {
            **DEFAULTS,
            "dataset": "pums",
            "data-path": str(data.resolve()),
            "partition-by": "puma",
            "seed": seed,
            "pums-age": age,
        }
    )
    clients = load_clients(**partition_kwargs(settings, 7))
    stack = lambda split, part: np.concatenate([np.asarray(getattr(getattr(c, split), part)) for c in clients])  # noqa: E731
    return (
        stack("train", "features"),
        stack("train", "labels"),
        stack("test", "features"),
        stack("test", "labels"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/pums/fulton_pums5_full.csv"))
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--pums-age", default="linear", choices=("linear", "bands"), help="the run-config key pums-age")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    scores: dict[str, list[float]] = {"logreg": [], "mlp": []}
    for seed in (int(s) for s in args.seeds.split(",")):
        x, y, xt, yt = pooled(args.data, seed, args.pums_age)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scores["logreg"].append(float(LogisticRegression(max_iter=2000).fit(x, y).score(xt, yt)))
            scores["mlp"].append(
                float(MLPClassifier(hidden_layer_sizes=(64,), max_iter=500, random_state=seed).fit(x, y).score(xt, yt))
            )
        print(
            f"seed {seed}: {len(y)} training rows, {len(yt)} test rows, "
            f"logreg {scores['logreg'][-1]:.4f}, mlp {scores['mlp'][-1]:.4f}",
            flush=True,
        )
    summary = {
        name: {"mean": statistics.mean(v), "sd": statistics.stdev(v) if len(v) > 1 else 0.0, "runs": v}
        for name, v in scores.items()
    }
    for name, s in summary.items():
        print(f"{name}: {s['mean']:.4f} ± {s['sd']:.4f}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
