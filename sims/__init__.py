"""Declarative simulation scenarios and the sweep runner (may import flwr; fedprivacy never does).

- `sims.inprocess`: an in-process Flower Grid that drives the real ServerApp and ClientApp.
- `sims.runner`: `Scenario` (a name, a run config, a client count) → `run_scenario` → the results
  folder the ServerApp wrote, read back by `read_results`.
- `sims.baseline`: the non-private FedAvg baseline on the same partitions, model and schedule.
- `sims.validation`: a validation file carved from the clients' training rows (never the test set).
- `sims.federated_pums`: the federated PUMS study (`python -m sims.federated_pums --data …`).
- `sims.sweep`: grids of runs from a scenario file or flags (`fedprivacy sweep`), resumable.
- `sims.engines`: what runs a sweep's cells, one module per engine (`inprocess`, `flower`).
- `sims.processes`: ending the processes the flower engine starts.
"""
