"""The built-in visual task (`toy:colours`, what `rollq up --model tiny-vl` trains): name the colour of a picture
by its letter, A red, B green, C blue or D yellow. The text is the same for every prompt, so only the image tells
the answer. The tiny Qwen2-VL starts knowing the answer format, not the colours (engine/tiny_vlm.py,
answer_prior): the four letters alike for any picture, chance 0.25. Pictures are 56x56 (four image tokens), each a
shade of its colour with noise, drawn from a seed: the same prompts on every machine."""

from __future__ import annotations

import random
from typing import Any

COLOURS = {"A": (220, 40, 40), "B": (40, 190, 60), "C": (40, 70, 220), "D": (230, 210, 40)}
QUESTION = "Which colour is the picture? A red, B green, C blue, D yellow. Answer with its letter."
SIZE = 56


def picture(letter: str, rng: random.Random) -> Any:
    """A SIZE x SIZE picture of the colour `letter` names: its shade moved by up to 25 per channel, and per-pixel
    noise of up to 20."""
    from PIL import Image  # the workers' and producers' dependency, not the protocol's

    base = [max(0, min(255, c + rng.randint(-25, 25))) for c in COLOURS[letter]]
    noise = rng.randbytes(SIZE * SIZE * 3)
    pixels = bytes(max(0, min(255, base[i % 3] + noise[i] % 41 - 20)) for i in range(SIZE * SIZE * 3))
    return Image.frombytes("RGB", (SIZE, SIZE), pixels)


def _prompts(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    letters = sorted(COLOURS)
    out = []
    for i in range(count):
        letter = letters[i % len(letters)]
        # the picture last: next to the answer, where a 2-layer model attends first
        messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"}]}]
        out.append({"messages": messages, "images": [picture(letter, rng)], "answer": letter, "id": i})
    return out


def prompts(count: int = 64) -> list[dict[str, Any]]:
    return _prompts(count, seed=0)


def held_out(count: int = 20) -> list[dict[str, Any]]:
    """Other pictures (another seed): evaluated greedily, they show the colours were learnt, not the pictures."""
    return _prompts(count, seed=1)


def colours_reward(
    prompt_text: str, completion_text: str, input_ids: Any = None, output_ids: Any = None, **data: Any
) -> float:
    """1.0 when the answer starts with the picture's letter, else 0. Any wrong answer scores alike: a wrong letter
    scored below the rest pushed every letter down early in some runs (3 wrong letters to each right one at
    chance), and the policy stopped writing letters at all (held-out 0 from step 10, a run of 200)."""
    return 1.0 if completion_text.strip()[:1] == data["answer"] else 0.0


__all__ = ["COLOURS", "QUESTION", "colours_reward", "held_out", "picture", "prompts"]
