"""Sweeps: a grid of federated runs from a scenario file or flags, run cell by cell through an engine.

- `spec`: the scenario (TOML tables or flags) validated whole into a `SweepSpec`;
- `flags`: the command's flags as a scenario's tables;
- `grid`: the cells (every combination of the grid), named and validated before anything runs;
- `engines`: how a cell runs on each engine, one module per `--engine` value;
- `driver`: runs the cells through an engine's cell runner, resumably, and writes sweep.csv;
- `baseline_jobs`: the non-private baseline once per distinct non-privacy setting, and its tuning's plan;
- `tune_spec`, `tuning`: [tune], each cell's (and baseline's) setting chosen on validation rows
  before it runs;
- `progress`: the progress bar, and a cell's round read from its rounds.csv.

The folder a sweep writes is described in fedprivacy.sweepfiles.
"""
