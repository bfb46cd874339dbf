"""The names of the built-in data sets, models and noise rules, with no heavy imports.

The run config and the `fedprivacy` command list these choices; naming them here lets them do so
without loading torch or dp-accounting (fedprivacy/models.py and fedprivacy/privacy/rules.py hold
the models and rules themselves; tests keep their registries equal to these names).
"""

DATASETS = ("digits", "pums", "csv", "synthetic")
FILE_DATASETS = ("pums", "csv")  # read from a file: a run's data-path, or a deployed node's own file
MODEL_NAMES = ("logreg", "mlp", "cnn")
RULE_NAMES = ("proactive", "calibrated", "calibrated-rdp", "adp")  # fedprivacy.privacy.rules.RULES, in its order
