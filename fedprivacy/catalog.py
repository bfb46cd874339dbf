"""The names of the built-in data sets, models, noise rules and aggregations, with no heavy imports.

The run config and the `fedprivacy` command list these choices; naming them here lets them do so
without loading torch or dp-accounting (fedprivacy/models.py, fedprivacy/privacy/rules.py and
fedprivacy/aggregation.py hold the models, rules and aggregations themselves; tests keep their
registries equal to these names).
"""

DATASETS = ("digits", "pums", "csv", "synthetic", "npz", "hf", "cifar10")  # fedprivacy.data.registry, in its order
PATH_DATASETS = ("pums", "csv", "npz", "hf", "cifar10")  # read from a run's data-path (a file or a folder)
FILE_DATASETS = ("pums", "csv")  # also a deployed node's own file: its node config's `dataset`
MODEL_NAMES = ("logreg", "mlp", "cnn")  # the built-ins; users register more (fedprivacy/model_registry.py)
RULE_NAMES = ("proactive", "calibrated", "calibrated-rdp", "adp")  # fedprivacy.privacy.rules.RULES, in its order
AGGREGATIONS = ("examples", "inverse-noise")  # fedprivacy.aggregation.aggregation_weight's schemes
