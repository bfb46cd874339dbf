"""The names of the built-in data sets and models, with no heavy imports.

The run config and the `fedprivacy` command list these choices; naming them here lets them do so
without loading torch (fedprivacy/models.py holds the models themselves, and a test keeps its
registry equal to `MODEL_NAMES`).
"""

DATASETS = ("digits", "pums", "csv", "synthetic")
FILE_DATASETS = ("pums", "csv")  # read from a file: a run's data-path, or a deployed node's own file
MODEL_NAMES = ("logreg", "mlp", "cnn")
