"""The built-in task for a real pretrained model (`--model smollm2`): single-digit additions asked in a chat, a
verifiable short answer. SmolLM2-135M-Instruct knows many of these sums when it writes them out ("7 + 5 = 12"), but
sampled at temperature 1 it mostly rambles past its 8-token budget ("To add 7 and 5, we ...") and ends on the right
number about one time in five. RL on the reward below teaches it to answer within the budget, and correctly.

The 100 pairs (a, b) with 0 <= a, b <= 9 are split once, by a fixed seed, into 80 training prompts (`toy:add`) and 20
held-out ones (`toy:add-heldout`) that the trainer only evaluates on."""

from __future__ import annotations

import random
import re
from typing import Any

SYSTEM = "You are a calculator. Reply with only the number."
HELD_OUT = 20
SPLIT_SEED = 1234
_NUMBER = re.compile(r"-?\d+")


def _pairs() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    return pairs[HELD_OUT:], pairs[:HELD_OUT]


def _record(a: int, b: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"}],
        "answer": a + b,
        "id": f"{a}+{b}",
    }


def prompts() -> list[dict[str, Any]]:
    """The training prompts (`toy:add`)."""
    return [_record(a, b) for a, b in _pairs()[0]]


def held_out() -> list[dict[str, Any]]:
    """The held-out prompts (`toy:add-heldout`), never trained on."""
    return [_record(a, b) for a, b in _pairs()[1]]


def addition_reward(
    prompt_text: str, completion_text: str, input_ids: Any = None, output_ids: Any = None, **data: Any
) -> float:
    """1 when the last number the answer writes is the sum, else 0 (the usual rule of math RLVR, GSM8K's): "12",
    "The answer is 12." and "7 + 5 = 12" score; "7 + 5 = 13", "7 + 5 + 2" and an answer cut off before any
    number do not."""
    found = _NUMBER.findall(completion_text)
    return float(bool(found) and int(found[-1]) == int(data["answer"]))


__all__ = ["SYSTEM", "addition_reward", "held_out", "prompts"]
