"""On the driver: a stage planned (`plan`), checked before it starts (`preflight`), resumed from the store
(`resume`), trained chunk by chunk on a worker group (`chunk`, `engine`), stopped on a signal (`stop`) and
exported (`export`, `stage_driver`). The top of rlhf_core: it may import every other package."""
