"""Simulations: engines that run a federation on one machine, sweeps over grids of runs, baselines.

- `sims.inprocess`: an in-process Flower Grid that drives the real ServerApp and ClientApp.
- `sims.fast`: the fast engine, a round's clients trained as one batched computation on workers.
- `sims.runner`: `Scenario` (a name, a run config, a client count) → `run_scenario` → the results
  folder the ServerApp wrote, read back by `read_results`.
- `sims.baseline`: the non-private FedAvg baseline on the same partitions, model and schedule.
- `sims.validation`: a validation file carved from the clients' training rows (never the test set).
- `sims.audit`: the empirical privacy audit (noise spread and a canary's ε lower bound).
- `sims.sweep`: grids of runs from a scenario file or flags (`fedprivacy sweep`), resumable; its
  `engines` run a cell on each engine, one module per `--engine` value (`inprocess`, `flower`, `fast`).
- `sims.processes`: a free port for the flower engine's SuperLink, and ending what it starts.
"""

import fedprivacy  # noqa: F401  # first: its OpenMP setting must be in place before PyTorch loads
