"""The built-in toy task of `rollq up`: write digits. A random-init model almost never does (reward ~0.01); a few
dozen GRPO steps teach it, so the run visibly learns on a CPU in minutes."""

from __future__ import annotations

from typing import Any

PROMPT = "Write a number using digits only."
TARGET_CHARS = 8


def digits_reward(prompt_text: str, completion_text: str, input_ids: Any = None, output_ids: Any = None,
                  **data: Any) -> float:
    """Fraction of the first 8 characters of the answer that are digits (a shorter answer scores less)."""
    return sum(c.isdigit() for c in completion_text[:TARGET_CHARS]) / TARGET_CHARS


def prompts(count: int = 64) -> list[dict[str, Any]]:
    return [{"prompt": PROMPT, "id": i} for i in range(count)]


__all__ = ["PROMPT", "digits_reward", "prompts"]
