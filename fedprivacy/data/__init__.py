"""Data sets by name (the registry, fedprivacy/data/registry.py: embedded digits, PUMS census CSV,
any CSV, synthetic logistic, npz arrays, Hugging Face datasets on disk, CIFAR-10 batches) and
federated partitions.

Start with `load_dataset(name, path, **options)`, `partition(dataset, scheme, ...)`, or
`load_client(partition_id, name, ...)` inside a ClientApp.
"""

from fedprivacy.data.loaders import load_dataset, synthetic_optimum
from fedprivacy.data.partition import load_client, load_clients, partition, partition_rows
from fedprivacy.data.splits import central_split
from fedprivacy.data.types import ClientData, Dataset

__all__ = [
    "ClientData",
    "Dataset",
    "central_split",
    "load_client",
    "load_clients",
    "load_dataset",
    "partition",
    "partition_rows",
    "synthetic_optimum",
]
