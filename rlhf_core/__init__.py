"""rlhf_core: the library behind the pipeline. It never imports prefect; flows and tasks wrap it."""
