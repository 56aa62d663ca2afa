"""The built-in toy task of `rollq up` (`toy:digits`): write digits. A random-init model almost never does (reward
~0.01); a few dozen GRPO steps teach it, so the run visibly learns on a CPU in minutes."""

from __future__ import annotations

from typing import Any

PROMPT = "Write a number using digits only."
TARGET_CHARS = 8


def digits_reward(
    prompt_text: str, completion_text: str, input_ids: Any = None, output_ids: Any = None, **data: Any
) -> float:
    """Fraction of the answer's characters that are digits, over at least 8 characters (a shorter answer scores
    less). Every character counts: a token that spells several letters costs as many, so no position of the
    answer is beyond the reward's reach (a reward on the first 8 characters let a long token push the rest out
    of view, and runs stalled there)."""
    return sum(c.isdigit() for c in completion_text) / max(TARGET_CHARS, len(completion_text))


def prompts(count: int = 64) -> list[dict[str, Any]]:
    return [{"prompt": PROMPT, "id": i} for i in range(count)]


__all__ = ["PROMPT", "digits_reward", "prompts"]
