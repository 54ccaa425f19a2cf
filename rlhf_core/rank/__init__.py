"""Inside a rank: the Ray actor (`worker`), the stage trainers, rollouts, rewards, PPO's arithmetic, the DeepSpeed
config, the in-memory snapshot. Imports models, data, ops, storage and the shared modules, never the driver's
code."""
