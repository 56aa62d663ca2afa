"""Workflows used by the tests (imported by workers by path, e.g. `tests.workflows:Echo`)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path


def trajectory(length: int, reward: float = 1.0, version: int = 0) -> dict:
    half = length // 2
    return {
        "input_ids": list(range(100, 100 + length)),
        "loss_mask": [0] * half + [1] * (length - half),
        "logprobs": [0.0] * half + [-0.25] * (length - half),
        "versions": [-1] * half + [version] * (length - half),
        "reward": reward,
    }


def _mark(data: dict, kind: str) -> None:
    """Leave a file so a test can see that a job started/finished in a given process."""
    directory = data.get("marker_dir")
    if directory:
        Path(directory, f"{kind}-{data.get('i', 0)}-{os.getpid()}").touch()


class Echo:
    """Returns a trajectory shaped by `data`; sleeps `data['sleep']` seconds unless ROLLQ_TEST_FAST is set."""

    async def arun_episode(self, engine, data):
        _mark(data, "start")
        if data.get("sleep") and not os.environ.get("ROLLQ_TEST_FAST"):
            await asyncio.sleep(data["sleep"])
        _mark(data, "end")
        return trajectory(data.get("len", 8), float(data.get("reward", data.get("i", 1))))


class SeeImages:
    """Reports what its data's images arrived as: reward = the red value of the first image's top-left pixel (a PIL
    image), + 1000 when `data["part"]` arrived as a data URI string."""

    async def arun_episode(self, engine, data):
        first = data["images"][0]
        assert type(first).__module__.startswith("PIL."), type(first)
        red = first.getpixel((0, 0))[0]
        uri = 1000 if str(data.get("part", "")).startswith("data:image/png;base64,") else 0
        return trajectory(4, float(red + uri))


class Boom:
    async def arun_episode(self, engine, data):
        raise RuntimeError(f"boom on {data.get('i')}")


class FailOnce:
    """Fails the first run of each job (remembered in a marker file), then succeeds."""

    async def arun_episode(self, engine, data):
        marker = Path(data["marker_dir"], f"failed-{data['i']}")
        if not marker.exists():
            marker.touch()
            raise ConnectionError("engine went away")
        return trajectory(4)


class Reject:
    async def arun_episode(self, engine, data):
        return None


class BadOutput:
    async def arun_episode(self, engine, data):
        return {"input_ids": [1, 2, 3], "loss_mask": [1, 1], "logprobs": [0.0, 0.0, 0.0], "reward": 1.0}


class MultiSequence:
    async def arun_episode(self, engine, data):
        return [trajectory(3, 0.5), trajectory(5, 1.5)]


class WithKwargs:
    def __init__(self, length: int) -> None:
        self.length = length

    async def arun_episode(self, engine, data):
        return trajectory(self.length)


async def function_workflow(engine, data):
    return trajectory(2)


class Generate:
    """A RolloutWorkflow that generates through the engine pool (token in, token out)."""

    async def arun_episode(self, engine, data):
        from rollq.engine.types import ModelRequest, SamplingParams

        prompt = list(data["prompt_ids"])
        resp = await engine.agenerate(
            ModelRequest(
                input_ids=prompt,
                sampling=SamplingParams(
                    max_new_tokens=data.get("max_new_tokens", 16),
                    ignore_eos=True,
                    temperature=data.get("temperature", 1.0),
                ),
                affinity=data.get("group", ""),
            )
        )
        n_out = len(resp.output_tokens)
        return {
            "input_ids": prompt + resp.output_tokens,
            "loss_mask": [0] * len(prompt) + [1] * n_out,
            "logprobs": [0.0] * len(prompt) + resp.output_logprobs,
            "versions": [-1] * len(prompt) + resp.output_versions,
            "reward": float(n_out),
        }


class ContextProbe:
    """Returns a trajectory whose reward is the id of the worker's shared httpx client (so a test can compare)."""

    async def arun_episode(self, engine, data):
        from rollq.workers.context import workflow_context

        return {**trajectory(4), "reward": float(id(workflow_context().http_client()) % 1_000_003)}


class Closable:
    """Counts its aclose() calls in a file, so a test can see the worker closed it on shutdown."""

    def __init__(self, marker: str) -> None:
        self.marker = Path(marker)

    async def arun_episode(self, engine, data):
        return trajectory(4)

    async def aclose(self) -> None:
        self.marker.write_text(str(int(self.marker.read_text() or 0) + 1) if self.marker.exists() else "1")


class HubOffline:
    """Reward 1.0 when the Hugging Face Hub is offline in this worker and in a process it starts (HF_HUB_OFFLINE),
    as huggingface_hub reads it; 0.0 otherwise."""

    async def arun_episode(self, engine, data):
        import subprocess
        import sys

        import huggingface_hub.constants

        child = subprocess.run(
            [sys.executable, "-c", "import os; print(os.environ.get('HF_HUB_OFFLINE', ''))"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" and huggingface_hub.constants.HF_HUB_OFFLINE and child == "1"
        return trajectory(4, 1.0 if offline else 0.0)
