"""Which models a job may name for a tokenizer or processor, and the directory each name stands for.

A job's workflow_kwargs come from whoever may submit (a tenant of the ingress, any Redis writer), and a model name
is a path to load: a job that named `/etc`, `~root` or a folder of another tenant's learnt which paths exist from
the errors (and loaded what it found), and a Hub id (`openai-community/gpt2`) made the worker download. So a job
names only rollq's built-in models (`tiny`, `smollm2`, `tiny-vl`), the worker's own `--tokenizer` (the operator's
choice), or a model folder named relative to the worker's `models_root`; everything else gets one error, the same
whatever is on disk. Workers also run with the Hugging Face Hub offline (`hub_offline`).

Every name a job gives passes through here: the kwarg converter (AReaL-shaped workflows), and `job_model_dir` for
the names rollq's built-in loops load themselves (`load_tokenizer`, their processors, AReaL's
`load_hf_tokenizer`), under the rules the worker installed for its tasks (`serving`). Code outside a worker (a
script, a test, the trainer) installs none and names any model directory, as the operator it is.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, MutableMapping
from pathlib import Path

import msgspec

from rollq.workers.resolver import WorkflowLoadError

BUILT_IN_MODELS = ("tiny", "smollm2", "tiny-vl")  # rollq.engine.models.model_dir builds these into its cache


class ModelNames(msgspec.Struct, frozen=True, kw_only=True):
    """Which model names a job's kwargs may give for a tokenizer or processor."""

    worker_tokenizer: str = "tiny"  # the worker's own --tokenizer (an operator's choice: always allowed)
    models_root: str = ""  # a directory whose model folders jobs may name (relative to it); "" = none

    def path(self, value: str, field: str = "tokenizer") -> Path:
        """The directory `value` stands for, if a job may name it; else WorkflowLoadError, one message for all."""
        if self._built_in(value):
            from rollq.engine.models import model_dir

            return model_dir(value)
        return self._under_root(value, field)

    def check(self, value: str, field: str = "tokenizer") -> None:
        """`path`'s refusal, without building a built-in model (a workflow's constructor checks its names early)."""
        if not self._built_in(value):
            self._under_root(value, field)

    def _built_in(self, value: object) -> bool:
        return isinstance(value, str) and (value in BUILT_IN_MODELS or value == self.worker_tokenizer)

    def _under_root(self, value: object, field: str) -> Path:
        root = self.models_root
        # Absolute paths, `~user` and Hub ids never reach the filesystem; `..` and links are resolved, then must stay
        # inside the root. What isn't a folder there gets the same refusal as what is outside it: no oracle.
        if root and isinstance(value, str) and value and not os.path.isabs(value) and not value.startswith("~"):
            base = Path(root).resolve()
            path = (base / value).resolve()
            if path.is_relative_to(base) and path != base and path.is_dir():
                return path
        raise WorkflowLoadError(
            f"workflow kwarg {field!r}={value!r}: not a model this worker lets jobs name; a job may name "
            f"{', '.join(BUILT_IN_MODELS)}, the worker's own tokenizer, or a model folder relative to the worker's "
            "models_root (--models-root DIR)"
        )


_ACTIVE: contextvars.ContextVar[ModelNames | None] = contextvars.ContextVar("rollq_model_names", default=None)


@contextlib.contextmanager
def serving(models: ModelNames) -> Iterator[None]:
    """Every model name loaded in this context (and the tasks and threads it starts) follows `models`' rules."""
    token = _ACTIVE.set(models)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def job_model_dir(name: str, field: str = "tokenizer") -> Path:
    """The directory of a model a workflow was given: under the worker's rules (`serving`); outside a worker, any
    name `rollq.engine.models.model_dir` takes."""
    models = _ACTIVE.get()
    if models is None:
        from rollq.engine.models import model_dir

        return model_dir(name)
    return models.path(name, field)


def check_job_model(name: str, field: str = "tokenizer") -> None:
    """`job_model_dir`'s refusal, without loading or building anything."""
    models = _ACTIVE.get()
    if models is not None:
        models.check(name, field)


def hub_offline(environ: MutableMapping[str, str]) -> None:
    """The Hugging Face Hub offline for this process and every process it starts: nothing a worker loads comes from
    the network (a name that got past every check still can't download). Set before `huggingface_hub` is imported,
    which reads it once."""
    environ["HF_HUB_OFFLINE"] = "1"


__all__ = ["BUILT_IN_MODELS", "ModelNames", "check_job_model", "hub_offline", "job_model_dir", "serving"]
