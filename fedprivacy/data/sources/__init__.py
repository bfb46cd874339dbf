"""One module per data source, each declaring `SOURCE` (a `fedprivacy.data.registry.Source`).

`fedprivacy.data.registry.sources()` imports every module here whose name does not start with an
underscore: adding a data set is adding a module (docs/data.md#adding-a-source).
"""
