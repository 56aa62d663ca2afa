"""`rollq weight-agent`: the host agent that prepares weight deltas for an engine that can only load full weights
from disk (SGLang). It reads a delta from the trainer's shared weights directory before the pause, rebuilds the
full version next to the engine from the last version it built, and answers the directory the engine then loads
at the swap (docs/engines.md, "SGLang engines: the weight agent").

- `config`: its settings (`rollq weight-agent`, the `weight_agent` section).
- `versions`: the full versions it keeps in its local directory, and how a full dir or a delta becomes the next.
- `server`: the HTTP routes (`POST /rollq/prepare_weights`, `GET /health`).
- `commands`: the command's entry.
"""
