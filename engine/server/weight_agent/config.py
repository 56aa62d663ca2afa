"""`rollq weight-agent`'s settings: the `weight_agent` section, ROLLQ_WEIGHT_AGENT_<KEY>, and the command's flags."""

from __future__ import annotations

from typing import Annotated

from rollq.config import Settings, setting
from rollq.engine.server.config import is_loopback


class WeightAgentConfig(Settings, kw_only=True):
    """The host agent of an SGLang engine: rebuilds full weights from deltas before the pause."""

    host: Annotated[str, setting("address to bind (the trainer must reach it)")] = "127.0.0.1"
    port: Annotated[int, setting("port to bind (0: a free one)", ge=0, le=65535)] = 30010
    weights_root: Annotated[
        str | None,
        setting(
            "the trainer's shared weights directory: every model_path a prepare names is resolved under it "
            "(anything outside it, or missing, is refused with one generic error); required",
            metavar="DIR",
        ),
    ] = None
    local_root: Annotated[
        str | None,
        setting(
            "where the agent writes the full versions it builds: a directory of its own (not inside weights_root, "
            "nor holding it) that the engine reads at the same path (the engine's weights_root must cover it); "
            "required",
            metavar="DIR",
        ),
    ] = None
    keep_versions: Annotated[
        int,
        setting(
            "full versions kept in local_root, newest first (2: the one the engine serves and the one prepared "
            "for the next swap); older ones are deleted",
            metavar="N",
            ge=1,
        ),
    ] = 2
    admin_api_key: Annotated[
        str | None,
        setting(
            "require `Authorization: Bearer KEY` on /rollq/prepare_weights: the engines' admin key, which the "
            "trainer sends (give it in the environment, ROLLQ_WEIGHT_AGENT_ADMIN_API_KEY)",
            metavar="KEY",
        ),
    ] = None
    insecure_no_auth: Annotated[
        bool,
        setting(
            "serve /rollq/prepare_weights without a key (anyone who reaches the agent can make it read weights "
            "under weights_root and write local_root); without a key and without this, the agent does not start"
        ),
    ] = False

    def refusal(self) -> str | None:
        """Why the agent must not start as configured; None when it may."""
        if not self.weights_root or not self.local_root:
            return (
                "weights_root and local_root are required (--weights-root DIR --local-root DIR, "
                "ROLLQ_WEIGHT_AGENT_WEIGHTS_ROOT / ROLLQ_WEIGHT_AGENT_LOCAL_ROOT)"
            )
        if not self.admin_api_key and not self.insecure_no_auth:
            where = "" if is_loopback(self.host) else f" (and host {self.host!r} is not a loopback address)"
            return (
                f"no admin key{where}: set admin_api_key (ROLLQ_WEIGHT_AGENT_ADMIN_API_KEY, the engines' admin key) "
                "or insecure_no_auth: true"
            )
        return None


__all__ = ["WeightAgentConfig"]
