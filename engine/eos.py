"""Which token ids end a model's reply: shared by the engines (synthetic backend) and the workers' stop ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def model_eos_ids(tokenizer: Any, directory: str | Path | None) -> list[int]:
    """The tokenizer's eos first (the one a scripted reply ends with), then generation_config.json's eos ids in
    `directory` (none: the tokenizer's only), without repeats: a model stops on any of them. Empty when neither
    names one."""
    own = tokenizer.eos_token_id
    ids: list[Any] = list(own) if isinstance(own, list) else [own] if own is not None else []
    extra = None
    try:
        if directory:
            extra = json.loads((Path(directory) / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):  # absent, unreadable or not a JSON object: the tokenizer's eos only
        extra = None
    ids += extra if isinstance(extra, list) else [extra] if isinstance(extra, int) else []
    return list(dict.fromkeys(int(i) for i in ids))


__all__ = ["model_eos_ids"]
