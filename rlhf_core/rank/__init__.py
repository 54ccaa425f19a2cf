"""Inside a rank: the Ray actor (`worker`), the stage trainers, models, data and samples, rollouts, rewards,
PPO's arithmetic, the DeepSpeed config, the in-memory snapshot. Imports ops, storage and the shared modules,
never the driver's code."""
