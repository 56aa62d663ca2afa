"""Agent workflows: any object with `run(self, data, **extra_kwargs)`, run against the recording proxy."""
