"""The built-in visual task (`toy:colours`, what `rollq up --model tiny-vl` trains): name the colour of a picture
by its letter, A red, B green, C blue or D yellow. The text is the same for every prompt, so only the image tells
the answer: a random-init model almost never writes one of the letters first, and a wrong one scores below
anything else (WRONG_LETTER), so which letter is learnt per picture. Pictures are 56x56 (four image tokens on the
tiny Qwen2-VL), each a shade of its colour with noise, drawn from a seed: the same prompts on every machine."""

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


# Another of the letters, not the picture's, scores below any other answer. Without that (0, or a bonus of 0.1 for
# any letter) a letter right for one picture rose for every picture: groups of the other pictures, all wrong, all
# scored alike and taught nothing, and the policy wrote one letter for everything (held-out 0.25-0.325 for 120
# steps in three runs). Below the rest, a wrong letter is pushed down for the picture it was wrong for.
WRONG_LETTER = -0.25


def colours_reward(
    prompt_text: str, completion_text: str, input_ids: Any = None, output_ids: Any = None, **data: Any
) -> float:
    """1.0 when the answer starts with the picture's letter, WRONG_LETTER with another of the four letters, else 0.
    A policy answering a letter at random scores 0.0625; 0.8 needs about 84 % of pictures named right."""
    letter = completion_text.strip()[:1]
    return 1.0 if letter == data["answer"] else WRONG_LETTER if letter in COLOURS else 0.0


__all__ = ["COLOURS", "QUESTION", "WRONG_LETTER", "colours_reward", "held_out", "picture", "prompts"]
