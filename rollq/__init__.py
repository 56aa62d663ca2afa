"""The `rollq` command: one entry point that hands each subcommand to the service that owns it."""
