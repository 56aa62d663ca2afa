"""The consumer side of RL: staleness ledger, batching, losses, the weight-update cycle, checkpoints, `rollq up`."""
