"""A test environment written in OpenEnv's own API (openenv.core.env_server), served by OpenEnv's own app factory
under uvicorn: `python openenv_length_env.py --port PORT [--report FILE]`. It runs in the OpenEnv virtualenv
(tests/environments/openenv-requirements.txt), never in rollq's.

The task: reply with a given number of characters, for `turns` turns (reset's keyword arguments `length` and
`turns`). Each step's reward is how close the reply's length came (1.0 exact, 0.0 at twice the length or more), so it
varies with whatever text a model writes, a tiny untrained one's gibberish included; done after `turns` steps.

`--report FILE`: the server writes where it runs into FILE when it starts (its pid, uid, working directory, HOME
and environment variable names), for the tests that check it runs as the episode's agent does.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field


class ReplyAction(Action):
    message: str = Field(description="the reply")


class LengthObservation(Observation):
    prompt: str = Field(description="what to do now")
    turn: int = Field(default=0, description="steps taken so far")


class LengthEnv(Environment[ReplyAction, LengthObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # no shared state: each WebSocket session has its own instance

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.length = 20
        self.turns = 3

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> LengthObservation:
        self.length = int(kwargs.get("length", 20))
        self.turns = int(kwargs.get("turns", 3))
        if self.length < 1 or self.turns < 1:
            raise ValueError("length and turns must be at least 1")
        self._state = State(episode_id=episode_id, step_count=0)
        return LengthObservation(prompt=f"Reply with exactly {self.length} characters.", turn=0)

    def step(self, action: ReplyAction, timeout_s: float | None = None, **kwargs: Any) -> LengthObservation:
        self._state.step_count += 1
        got = len(action.message)
        reward = round(max(0.0, 1.0 - abs(got - self.length) / self.length), 6)
        done = self._state.step_count >= self.turns
        return LengthObservation(
            prompt=f"That was {got} characters. Reply with exactly {self.length} characters.",
            turn=self._state.step_count,
            reward=reward,
            done=done,
        )

    @property
    def state(self) -> State:
        return self._state


app = create_app(LengthEnv, ReplyAction, LengthObservation, env_name="length", max_concurrent_envs=64)


def report(path: str) -> None:
    where = {
        "pid": os.getpid(),
        "uid": os.getuid(),
        "cwd": os.getcwd(),
        "home": os.environ.get("HOME", ""),
        "env": sorted(os.environ),
    }
    with open(path, "w") as f:
        json.dump(where, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--report", default="")
    args = parser.parse_args()
    if args.report:
        report(args.report)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
