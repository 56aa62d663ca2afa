"""rollq's built-in toy tasks: their prompts (the trainer's `toy:NAME` datasets) and their reward functions (which
workers resolve from jobs: always on the allowlist, rollq.workers.resolver.BUILTIN_ALLOWED). Both sides read them
here, so neither imports the other.

- `rollq.tasks.digits` (`toy:digits`): write digits; the tiny model's task in `rollq up`.
- `rollq.tasks.addition` (`toy:add`, `toy:add-heldout`): single-digit additions in a chat; `--model smollm2`'s task.
"""
