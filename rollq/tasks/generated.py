"""Generated tasks: reasoning-gym's procedural datasets (`dataset=reasoning-gym:NAME`) or a user's own generator of
the same shape (`dataset=MODULE:FACTORY`), as prompts for the trainer and as the reward on the workers.

A task is built from its source, size, seed and config (TaskSpec): `reasoning_gym.create_dataset(NAME, size=,
seed=, **config)`, or `FACTORY(size=, seed=, **config)` for a user's own. What comes back is indexable (`task[i]`,
i < size) into entries with `question` and `answer` (and reasoning-gym's `metadata`) and has `score_answer(answer,
entry) -> float`. Each prompt's job data carries the spec and its entry, so a worker rebuilds the same object
and scores with it (rollq.workers.builtin.task_reward, which resolves a user's factory under the worker's
allowlist; this module imports no service, so it takes how to load a factory as an argument).
"""

from __future__ import annotations

import difflib
import importlib
import json
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import msgspec

REASONING_GYM = "reasoning-gym:"
TASK_REWARD = "rollq.workers.builtin.task_reward:task_reward"  # the reward these datasets bring
# A user's factory: `package.module:name` (a path, not a file: `data.jsonl` and `toy:NAME` are other sources).
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
MAX_SIZE = 10_000_000  # a job's spec can't ask a worker to build a task of billions of entries
INSTALL_HINT = "pip install 'rollq[tasks]'"
NAMES_HINT = (
    "reasoning-gym's task names: `python -c 'import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))'` "
    "or its GALLERY.md (github.com/open-thought/reasoning-gym)"
)


class TaskError(ValueError):
    """A task source that can't be built or generated (unknown name, bad config, entries of the wrong shape)."""


class TaskSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What builds a task: carried in every job's data (`task`), so a worker rebuilds the scorer the prompts came
    from."""

    source: str  # "reasoning-gym:NAME" or "module:factory"
    size: Annotated[int, msgspec.Meta(ge=1, le=MAX_SIZE)]
    seed: int
    config: dict[str, Any] = {}

    def key(self) -> str:
        """The spec as JSON (its config as JSON: what a job's data can carry); TaskError for a config that is not."""
        try:
            return json.dumps([self.source, self.size, self.seed, self.config], sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise TaskError(f"task {self.source!r}: task_config must hold JSON values only ({exc})") from None


def is_task_source(spec: str) -> bool:
    """Whether a dataset setting names a generated task (not a file, a saved dataset or a `toy:` task). The caller
    checks first that no file of that name exists."""
    return spec.startswith(REASONING_GYM) or (not spec.startswith("toy:") and bool(_FACTORY.match(spec)))


def reasoning_gym_registry() -> dict[str, Any]:
    """reasoning-gym's tasks by name: (dataset class, config class) (reasoning_gym/factory.py:14, what
    create_dataset looks names up in)."""
    return dict(_reasoning_gym().factory.DATASETS)


def _reasoning_gym() -> Any:
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError:
        raise TaskError(f"reasoning-gym tasks need the reasoning-gym package: {INSTALL_HINT}") from None


def _reasoning_gym_utils() -> Any:
    _reasoning_gym()
    return importlib.import_module("reasoning_gym.utils")


def import_factory(source: str) -> Callable[..., Any]:
    """A user's factory, imported as any Python import is: for the trainer, which runs its own settings. Workers
    load one from a job only under their allowlist (rollq.workers.builtin.task_reward)."""
    module, _, name = source.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise TaskError(f"task {source!r}: cannot import module {module!r}: {exc}") from None
    except AttributeError:
        raise TaskError(f"task {source!r}: module {module!r} has no attribute {name!r}") from None
    if not callable(factory):
        raise TaskError(f"task {source!r} is a {type(factory).__name__}, not a class or function that builds a task")
    return factory


def build(spec: TaskSpec, load_factory: Callable[[str], Callable[..., Any]] = import_factory) -> Any:
    """The task object `spec` names: reasoning-gym's dataset, or what the user's factory (`load_factory(source)`)
    builds."""
    if "size" in spec.config or "seed" in spec.config:
        raise TaskError("task_config must not hold size or seed: they are the settings task_size and task_seed")
    if spec.source.startswith(REASONING_GYM):
        name = spec.source[len(REASONING_GYM) :]
        rg = _reasoning_gym()
        registry = reasoning_gym_registry()
        if name not in registry:
            close = difflib.get_close_matches(name, list(registry), n=3)
            maybe = f" (did you mean {', '.join(close)}?)" if close else ""
            raise TaskError(f"reasoning-gym has no task {name!r}{maybe}; {NAMES_HINT}")
        make: Callable[..., Any] = rg.create_dataset
        args: tuple[Any, ...] = (name,)
    else:
        make, args = load_factory(spec.source), ()
    try:
        # create_dataset builds the task's config dataclass from these keywords and runs its validate()
        # (reasoning_gym/factory.py:51-73): an unknown field is a TypeError, a bad value an AssertionError.
        return make(*args, size=spec.size, seed=spec.seed, **spec.config)
    except (TypeError, ValueError, AssertionError) as exc:
        raise TaskError(
            f"task {spec.source!r} rejects its config {spec.config!r}: {type(exc).__name__}: {exc}"
        ) from None


def _checked(spec: TaskSpec, index: int, entry: Any) -> dict[str, Any]:
    """An entry as the wire will carry it (msgpack keeps what JSON keeps; tuples become lists)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("question"), str) or "answer" not in entry:
        raise TaskError(f"task {spec.source!r} entry {index} is not a mapping with a `question` string and an `answer`")
    try:
        return msgspec.json.decode(msgspec.json.encode(entry))
    except (TypeError, msgspec.EncodeError) as exc:
        raise TaskError(f"task {spec.source!r} entry {index} can't travel in a job (JSON): {exc}") from None


def _entries(task: Any, spec: TaskSpec) -> list[dict[str, Any]]:
    entries = []
    for index in range(spec.size):
        try:
            entry = task[index]
        except Exception as exc:  # the task's own code: any failure is its config's or its own
            raise TaskError(
                f"task {spec.source!r} with config {spec.config!r} failed on entry {index}: {type(exc).__name__}: {exc}"
            ) from None
        entries.append(_checked(spec, index, entry))
    return entries


def worked_examples(task: Any, spec: TaskSpec) -> list[dict[str, Any]]:
    """Entries shown before a question as earlier turns of the chat: the question, then its answer in the form the
    reward reads (<answer>ANSWER</answer>). A small model that never writes the tags when asked to (SmolLM2-135M:
    none in 96 samples) copies them from one example (40% of its samples)."""
    return _entries(task, spec)


def entry_record(
    spec: TaskSpec,
    index: int,
    entry: dict[str, Any],
    system_prompt: str,
    examples: Sequence[dict[str, Any]] = (),
    shown: int = 0,
) -> dict[str, Any]:
    """A job's data for one entry: the question as a chat (after up to `shown` worked examples that are not this
    question), and what the scorer needs (the spec and the entry)."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for example in [e for e in examples if e["question"] != entry["question"]][:shown]:
        messages.append({"role": "user", "content": example["question"]})
        messages.append({"role": "assistant", "content": f"<answer>{example['answer']}</answer>"})
    messages.append({"role": "user", "content": entry["question"]})
    # `entry` is for people and the trainer; a worker scores against task[index], rebuilt from the spec, never
    # against the entry a job carries (some scorers eval parts of it: rollq.workers.builtin.task_reward)
    return {
        "messages": messages,
        "task": msgspec.to_builtins(spec),
        "index": index,
        "entry": entry,
        "id": f"{spec.seed}:{index}",
    }


def generate(
    task: Any,
    spec: TaskSpec,
    system_prompt: str,
    examples: Sequence[dict[str, Any]] = (),
    shown: int = 0,
) -> list[dict[str, Any]]:
    """The job data of every entry of `task` (built from `spec`)."""
    return [
        entry_record(spec, index, entry, system_prompt, examples, shown)
        for index, entry in enumerate(_entries(task, spec))
    ]


def system_prompt(name_or_text: str) -> str:
    """reasoning-gym's system prompt of that name (reasoning_gym/utils.py:8 SYSTEM_PROMPTS: each asks for the
    answer inside <answer></answer>, what its extraction reads), or the text itself when it is not a bare name;
    '' for none."""
    if not name_or_text or re.search(r"\s", name_or_text):
        return name_or_text
    prompts = _reasoning_gym_utils().SYSTEM_PROMPTS
    if name_or_text not in prompts:
        raise TaskError(
            f"task_system_prompt {name_or_text!r} is not one of reasoning-gym's ({', '.join(prompts)}); give a "
            "sentence to use your own text"
        )
    return str(prompts[name_or_text])


def extract_answer(task: Any, completion: str) -> str | None:
    """The answer in a completion: the task's own `extract_answer(completion)` when it has one, else reasoning-gym's
    (reasoning_gym/utils.py:25: the text inside the last <answer>...</answer>, stripped; None without one)."""
    own = getattr(task, "extract_answer", None)
    if callable(own):
        return own(completion)
    answer = _reasoning_gym_utils().extract_answer(completion)
    return None if answer is None else str(answer)


__all__ = [
    "REASONING_GYM",
    "TASK_REWARD",
    "TaskError",
    "TaskSpec",
    "build",
    "entry_record",
    "extract_answer",
    "generate",
    "import_factory",
    "is_task_source",
    "reasoning_gym_registry",
    "system_prompt",
]
