"""The `areal.utils` names AReaL's own workflow files import, with AReaL's signatures (read from areal 1.0.4's
source), so those files run in a rollq worker with only their import lines changed:

- `logging.getLogger(name, type_=None, level=None)`: a standard logger under `rollq.workflow.`.
- `stats_tracker` (rollq.workers.stats): recorded per worker, served on its /metrics.
- `import_from_string("pkg.mod.Name")`: through the worker's allowlist, like every import a job causes.
- `apply_chat_template(tokenizer, messages, tokenize=True, **kw)`: token ids as a list on every transformers version.
- `image2base64(images)`: PIL images as base64 PNG strings (what a request's `image_data` takes).
- `load_hf_tokenizer(name)`: `tiny`, `smollm2` or a tokenizer directory; pad falls back to eos, as in AReaL.
- perf tracing (`trace_session`, `session_context`, `atrace_session_phase`, `trace_session_phase`): each phase's
  seconds are recorded as `perf/<phase>_s` in the stats (AReaL writes them to its session tracer).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging as _stdlib_logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from rollq.workers.context import stats_tracker
from rollq.workers.resolver import resolve


class _Logging:
    """`areal.utils.logging`: getLogger with AReaL's signature (its `type_` picks a format; rollq's logging
    configuration decides formats, so it is accepted and not used)."""

    @staticmethod
    def getLogger(  # AReaL's name
        name: str | None = None, type_: str | None = None, level: int | None = None
    ) -> _stdlib_logging.Logger:
        logger = _stdlib_logging.getLogger(f"rollq.workflow.{name or 'plain'}")
        if level is not None:
            logger.setLevel(level)
        return logger


logging = _Logging()


def import_from_string(module_path: str) -> Any:
    """The object `module_path` ("pkg.mod.Name" or "pkg.mod:Name") names, if the worker's allowlist allows it."""
    if not module_path or not isinstance(module_path, str):
        raise ValueError(f"Invalid module path: {module_path!r}. Expected a string like 'module.path.ObjectName'.")
    return resolve(module_path)


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], *, tokenize: bool = True, **kwargs: Any) -> Any:
    """tokenizer.apply_chat_template, with the ids as a list[int] also where transformers 5 returns an encoding."""
    result = tokenizer.apply_chat_template(messages, tokenize=tokenize, **kwargs)
    if tokenize and not isinstance(result, list):
        return list(result["input_ids"])
    return result


def load_hf_tokenizer(model_name_or_path: str, fast_tokenizer: bool = True, padding_side: str | None = None) -> Any:
    """A tokenizer by rollq's model names (`tiny`, `smollm2`) or from a directory, in a worker only what its jobs
    may name (rollq.workers.model_names); never downloads."""
    from transformers import AutoTokenizer  # heavy: only when a workflow asks

    from rollq.workers.model_names import job_model_dir

    kwargs = {} if padding_side is None else {"padding_side": padding_side}
    path = job_model_dir(model_name_or_path, "model_name_or_path")
    tokenizer = AutoTokenizer.from_pretrained(path, use_fast=fast_tokenizer, **kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    return tokenizer


def image2base64(images: Any) -> list[str]:
    """`areal.utils.image.image2base64`: a PIL image or a list of them as plain base64 of PNG files (SGLang's
    image_data form), one string per image."""
    from rollq.protocol.media import pil_to_image_file

    return [pil_to_image_file(image).base64() for image in (images if isinstance(images, list | tuple) else [images])]


def _record_phase(phase: str, seconds: float) -> None:
    stats_tracker.get("perf").scalar(**{f"{phase}_s": seconds})


@contextlib.contextmanager
def trace_session_phase(
    phase: str, *, start_payload: dict[str, Any] | None = None, end_payload: dict[str, Any] | None = None
) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        _record_phase(phase, time.perf_counter() - start)


@contextlib.asynccontextmanager
async def atrace_session_phase(
    phase: str, *, start_payload: dict[str, Any] | None = None, end_payload: dict[str, Any] | None = None
) -> AsyncIterator[None]:
    with trace_session_phase(phase):
        yield


def trace_session(phase: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: each call of the function is one `phase` (sync or async functions)."""

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def traced_async(*args: Any, **kwargs: Any) -> Any:
                with trace_session_phase(phase):
                    return await func(*args, **kwargs)

            return traced_async

        @functools.wraps(func)
        def traced(*args: Any, **kwargs: Any) -> Any:
            with trace_session_phase(phase):
                return func(*args, **kwargs)

        return traced

    return decorator


def session_context() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: AReaL opens a tracing session per call; in rollq the episode is the session, so the function is
    returned as it is."""

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        return func

    return decorator


__all__ = [
    "apply_chat_template",
    "atrace_session_phase",
    "image2base64",
    "import_from_string",
    "load_hf_tokenizer",
    "logging",
    "session_context",
    "stats_tracker",
    "trace_session",
    "trace_session_phase",
]
