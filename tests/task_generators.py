"""Users' own task generators for the tests (rollq.tasks.generated): objects of reasoning-gym's shape, built with
size, seed and their config; indexable into entries with a question and an answer; scoring with score_answer."""

from __future__ import annotations

import random
from typing import Any


class NextNumber:
    """ "What number comes after N?" for N up to `top`; scored 1 for the right number, else 0."""

    def __init__(self, size: int, seed: int, top: int = 9) -> None:
        if top < 1:
            raise ValueError("top must be >= 1")
        self.size, self.seed, self.top = size, seed, top

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = random.Random(self.seed * 1_000_003 + index).randint(0, self.top)
        return {"question": f"What number comes after {n}?", "answer": str(n + 1), "metadata": {"n": n}}

    def score_answer(self, answer: str | None, entry: dict[str, Any]) -> float:
        return 1.0 if answer is not None and answer.strip() == entry["answer"] else 0.0


def make(size: int, seed: int, **config: Any) -> NextNumber:
    return NextNumber(size, seed, **config)


class AnyText(NextNumber):
    """Reads the whole completion as the answer (its own extract_answer) and scores its length: every completion a
    model writes scores above 0, so a run shows that this scorer, on the workers, gave the rewards."""

    def extract_answer(self, completion: str) -> str:
        return completion

    def score_answer(self, answer: str | None, entry: dict[str, Any]) -> float:
        return min(1.0, len(answer or "") / 16) or 0.01


def make_any_text(size: int, seed: int, **config: Any) -> AnyText:
    return AnyText(size, seed, **config)
