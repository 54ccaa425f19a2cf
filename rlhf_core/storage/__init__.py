"""Storage: where a run's bytes live and what makes them committed and durable (checkpoints, their manifests,
the media behind them, the run lease, safe loading, finding models and hub ids, writability). Imports only the shared
modules at the top of rlhf_core."""
