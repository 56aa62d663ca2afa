"""Module-level reward functions for tests/workers/test_rewards.py (children import them by name)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def exact_match(answer: str, target: str = "42") -> float:
    return 1.0 if answer.strip() == target else 0.0


def sleepy(seconds: float, value: float = 1.0) -> float:
    time.sleep(seconds)
    return value


def pid_of_worker() -> int:
    return os.getpid()


def record_pid_then_hang(pid_file: str) -> float:
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(60)
    return 1.0


def raises(message: str) -> float:
    raise ValueError(message)


def returns(value: object) -> object:
    return value


def hard_exit(code: int) -> float:
    os._exit(code)


def dispatch(kind: str, *args: object) -> object:
    """One wrapper per test module can exercise every behaviour, reusing its children across tests."""
    return globals()[kind](*args)


def hang_forever(*args: object, **kwargs: object) -> float:
    """Never returns (the wrapper's timeout must kill it); takes any arguments, so workflows can call it too."""
    while True:
        time.sleep(3600)


def completion_reward(prompt, completion, input_ids, output_ids, bonus: float = 0.0, **data: object) -> float:
    """Workflow-shaped, with AReaL's parameter names: the data key "prompt" must be left out of the kwargs."""
    return float(len(output_ids)) + bonus


def answer_in_completion(prompt, completions, prompt_ids, completion_ids, **data: object) -> float:
    """AReaL's reward_fn signature (areal/api/reward_api.py): 1.0 when the sample's answer is in the completion."""
    return float(str(data["answer"]) in completions)


def mapped_answer(prompt_text: str, completion_text: str, input_ids: list, output_ids: list, **data: object) -> float:
    """1 when the line's mapped prompt reached the model and its mapped `answer` reached the reward (prompt_key,
    answer_key); raises when `answer` is missing, so a failure cannot pass for a reward."""
    return 1.0 if data["answer"] == "5" and "What is 2 + 3?" in prompt_text else 0.0
