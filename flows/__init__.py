"""Prefect flows and the `rlhf` command: the outermost layer."""
