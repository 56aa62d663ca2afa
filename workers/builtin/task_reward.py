"""The reward of generated tasks (`dataset=reasoning-gym:NAME` or `MODULE:FACTORY`, rollq.tasks.generated): the
task's own `score_answer` on the answer its extraction finds, with the task object rebuilt on the worker from what
the job's data carries (`task`: source, size, seed, config; `entry`: the question's entry) and kept per process.

Imports a job can cause: reasoning-gym's tasks are looked up by name in its own registry (no import); a user's
factory is an import path, so it is resolved under the allowlist the worker enforces for the job (its tenant's
patterns included) on every call, and refused where none is active (a reward's child process, a reward worker)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import msgspec

from rollq.tasks.generated import REASONING_GYM, TaskError, TaskSpec, build, extract_answer
from rollq.workers.resolver import active_allowlist, resolve

CACHE_SIZE = 32  # task objects kept per process (a job's data picks the spec: bounded, whatever jobs name)


def allowed_factory(source: str) -> Callable[..., Any]:
    """A user's factory named by a job: only under the allowlist active here."""
    if active_allowlist() is None:
        raise TaskError(
            f"task {source!r} names a module to import, and no allowlist is active here: a user's task is scored "
            "inline in a rollq worker (reward_mode inline), whose allowlist (--allow) decides what it may import"
        )
    factory = resolve(source)
    if not callable(factory):
        raise TaskError(f"task {source!r} is a {type(factory).__name__}, not a class or function that builds a task")
    return factory


def cached_task(spec: TaskSpec) -> Any:
    """The task object of `spec`, built once per process. A user's factory is resolved (and so checked against the
    allowlist active now, the job's) on every call, before the cache is read: a cached object is no way around
    another job's narrower list."""
    if not spec.source.startswith(REASONING_GYM):
        allowed_factory(spec.source)
    return _built_task(spec.key())


@functools.lru_cache(maxsize=CACHE_SIZE)  # thread-safe (inline rewards run in threads); two may build at once
def _built_task(key: str) -> Any:
    """The task of TaskSpec.key() `key` (JSON: the spec's fields, which came from a job's JSON data)."""
    source, size, seed, config = json.loads(key)
    return build(TaskSpec(source=source, size=size, seed=seed, config=config), allowed_factory)


def task_reward(
    prompt_text: str, completion_text: str, input_ids: Any = None, output_ids: Any = None, **data: Any
) -> float:
    """The task's own score of the answer the completion gives: `score_answer(extract_answer(completion), entry)`.
    A completion without an answer in the expected form scores what the task gives None (reasoning-gym: 0)."""
    if "task" not in data or "entry" not in data:
        raise TaskError("task_reward scores generated tasks: the job's data needs `task` and `entry` (their prompts)")
    try:
        spec = msgspec.convert(data["task"], TaskSpec)
    except msgspec.ValidationError as exc:
        raise TaskError(f"the job's `task` is not a task spec: {exc}") from None
    task = cached_task(spec)
    return float(task.score_answer(extract_answer(task, completion_text), data["entry"]))


__all__ = ["CACHE_SIZE", "allowed_factory", "cached_task", "task_reward"]
