"""The consumer side of RL: staleness ledger, batching, losses, weight-update cycle (see the trainer issue)."""
