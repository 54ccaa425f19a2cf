"""Prefect tasks: thin adapters (retries, cache keys, result storage) over rlhf_core."""
