"""The reward of generated tasks (`dataset=reasoning-gym:NAME` or `MODULE:FACTORY`, rollq.tasks.generated): the
task's own `score_answer` on the answer its extraction finds, with the task object rebuilt on the worker from what
the job's data carries (`task`: source, size, seed, config; `index`: the entry's position) and kept per process.
The entry scored against is rebuilt here as `task[index]`: never the `entry` a job carries, whose fields some
reasoning-gym scorers pass to `eval` (number_sorting's answer, bitwise_arithmetic's problem).

Scorers that evaluate the model's answer as code: several reasoning-gym tasks `eval` it or parse it with sympy
(which evals), e.g. reasoning_gym/algorithmic/string_insertion.py:88, games/n_queens.py:155, games/countdown.py:221.
The completion is the policy's text, which a tenant's prompt can steer, so such a task is scored only where the
allowlist the worker enforces for the job allows `reasoning_gym.NAME` (the operator's `--allow`; `rollq up` allows
its own run's task); closed by default.

Imports a job can cause: reasoning-gym's tasks are looked up by name in its own registry (no import); a user's
factory is an import path, so it is resolved under the allowlist the worker enforces for the job (its tenant's
patterns included) on every call, and refused where none is active (a reward's child process, a reward worker)."""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from typing import Any

import msgspec

from rollq.tasks.generated import REASONING_GYM, TaskError, TaskSpec, build, extract_answer
from rollq.workers.resolver import active_allowlist, resolve

CACHE_SIZE = 32  # task objects kept per process (a job's data picks the spec: bounded, whatever jobs name)


# What a task's module must not hold for it to be scored without the operator's consent: the Python or sympy
# evaluation of strings (reading the installed package: see the module docstring).
EVALUATES = ("eval(", "exec(", "sympy", "sympify", "parse_expr")


@functools.lru_cache(maxsize=256)
def scorer_evaluates(name: str) -> bool:
    """Whether reasoning-gym task `name`'s module evaluates strings (its scorer may run the model's answer as code);
    True when its source cannot be read (assume the worst)."""
    from rollq.tasks.generated import reasoning_gym_registry

    try:
        source = inspect.getsource(inspect.getmodule(reasoning_gym_registry()[name][0]))  # type: ignore[arg-type]
    except (OSError, TypeError, KeyError):
        return True
    return any(token in source for token in EVALUATES)


def allowed_scorer(name: str) -> None:
    """A reasoning-gym task whose scorer evaluates answers: only where the job's allowlist allows it."""
    allowlist = active_allowlist()
    if scorer_evaluates(name) and (allowlist is None or not allowlist.allows(f"reasoning_gym.{name}")):
        raise TaskError(
            f"reasoning-gym's {name!r} scores answers by evaluating them (Python eval or sympy), and the completion "
            f"is the policy's text: it is scored only where the operator allows it (--allow reasoning_gym.{name}; "
            "`rollq up` allows its own run's task)"
        )


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
    if spec.source.startswith(REASONING_GYM):
        allowed_scorer(spec.source[len(REASONING_GYM) :])
    else:
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
    if "task" not in data or "index" not in data:
        raise TaskError("task_reward scores generated tasks: the job's data needs `task` and `index` (their prompts)")
    try:
        spec = msgspec.convert(data["task"], TaskSpec)
    except msgspec.ValidationError as exc:
        raise TaskError(f"the job's `task` is not a task spec: {exc}") from None
    index = data["index"]
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < spec.size:
        raise TaskError(f"the job's `index` must be an entry's position in its task (0 to {spec.size - 1}): {index!r}")
    task = cached_task(spec)
    entry = task[index]  # rebuilt from the spec: what the trainer made, not what a job says it made
    return float(task.score_answer(extract_answer(task, completion_text), entry))


__all__ = [
    "CACHE_SIZE",
    "EVALUATES",
    "allowed_factory",
    "allowed_scorer",
    "cached_task",
    "scorer_evaluates",
    "task_reward",
]
