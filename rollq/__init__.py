"""rollq: distributed rollouts for RL of LLMs and LLM agents over Redis streams.

One import package. Its sub-packages `rollq.protocol`, `rollq.producer`, `rollq.workers`, `rollq.engine` and
`rollq.trainer` live in the repository's top-level folders and are mapped into it by setuptools' `package-dir`
(pyproject.toml). This folder itself holds the `rollq` command (`rollq.cli`) and the leaves every service may use:
`rollq.config` (typed settings from the config file, `ROLLQ_*` variables and flags), `rollq.redis_client`,
`rollq.http_server`, `rollq.metrics_server` (the `/metrics` server), `rollq.module_paths` (where user modules are
imported from) and `rollq.tasks` (the built-in toy tasks).
"""

import os as _os

# From a source checkout whose root is on sys.path (Python started there), this folder is the `rollq` found first,
# and the mapped sub-packages are its siblings rather than its children: let the package find them there. An
# installed copy (a wheel, or an editable install's import hook) has them in place and skips this.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "pyproject.toml")) and _os.path.isfile(
    _os.path.join(_checkout, "protocol", "messages.py")
):
    __path__.append(_checkout)
