"""A job's JSON `kwargs` -> the objects a workflow's constructor takes, by its type hints, so AReaL's own
RolloutWorkflows are named in a job directly, no factory class:

    {"workflow": "areal.workflow.rlvr:RLVRWorkflow",
     "kwargs": {"reward_fn": "my_pkg.rewards:math", "gconfig": {"max_new_tokens": 256}, "tokenizer": "tiny"}}

- a mapping for a dataclass (or msgspec Struct) parameter (GenerationHyperparameters) is that class built from it;
- a string for a tokenizer or processor parameter (by its hint, PreTrainedTokenizer*/ProcessorMixin/AutoProcessor,
  or by its name when unannotated) is loaded: `tiny`, `smollm2`, `tiny-vl`, the worker's own `--tokenizer`, or a
  directory under the worker's `models_root`. A job never names an arbitrary path: its kwargs come from whoever
  may submit;
- a string for a Callable parameter (or an unannotated `..._fn`, AReaL's naming) is an import path, resolved
  through the worker's allowlist (a workflow that imported it itself would import what the allowlist never saw).
  rollq's own workflows resolve theirs themselves, through the same allowlist (a remote reward is only named: it
  may exist on the reward workers alone).

Anything else passes as it is; a value of the wrong kind for its parameter is the constructor's to refuse.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import types
import typing
from pathlib import Path
from typing import Any

import msgspec

from rollq.workers.model_names import ModelNames
from rollq.workers.resolver import WorkflowLoadError, resolve

_TOKENIZER_HINTS = ("Tokenizer",)
_PROCESSOR_HINTS = ("Processor",)


class KwargConverter:
    """Converts kwargs for one worker; loaded tokenizers are kept, one per name."""

    def __init__(self, models: ModelNames | None = None) -> None:
        self.models = models or ModelNames()
        self._loaded: dict[tuple[str, str], Any] = {}

    def convert(self, cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            signature = inspect.signature(cls)
        except (TypeError, ValueError):
            return kwargs
        hints = _hints(cls)
        own = getattr(cls, "__module__", "").startswith("rollq.")
        out = dict(kwargs)
        for name, value in kwargs.items():
            param = signature.parameters.get(name)
            if param is None:
                continue
            hint = hints.get(name, param.annotation)
            out[name] = self._value(name, hint, value, resolve_paths=not own)
        return out

    def _value(self, name: str, hint: Any, value: Any, *, resolve_paths: bool) -> Any:
        options = _options(hint)
        if isinstance(value, collections.abc.Mapping):
            for option in options:
                if inspect.isclass(option) and (dataclasses.is_dataclass(option) or issubclass(option, msgspec.Struct)):
                    try:
                        return option(**value)
                    except TypeError as exc:
                        raise WorkflowLoadError(f"workflow kwarg {name!r}: {option.__name__}: {exc}") from None
            return value
        if not isinstance(value, str):
            return value
        text = " ".join(_spelled(o) for o in options) if options else ""
        if any(h in text for h in _TOKENIZER_HINTS) or (not options and name == "tokenizer"):
            return self._load(value, "tokenizer", name)
        if any(h in text for h in _PROCESSOR_HINTS) or (not options and name == "processor"):
            return self._load(value, "processor", name)
        wants_callable = any(_is_callable(o) for o in options) or (not options and name.endswith("_fn"))
        if resolve_paths and wants_callable:
            return resolve(value)
        return value

    def _load(self, value: str, kind: str, name: str) -> Any:
        key = (kind, value)
        if key not in self._loaded:
            path = self.model_path(value, name)
            from transformers import AutoTokenizer  # heavy: only for workflows that take one

            from rollq.engine.tiny_vlm import load_processor

            loaded = AutoTokenizer.from_pretrained(path) if kind == "tokenizer" else load_processor(path)
            if kind == "tokenizer" and loaded.pad_token_id is None:
                loaded.pad_token_id = loaded.eos_token_id  # as AReaL's load_hf_tokenizer
            self._loaded[key] = loaded
        return self._loaded[key]

    def model_path(self, value: str, name: str) -> Path:
        """The directory a model name stands for, if a job may name it (rollq.workers.model_names)."""
        return self.models.path(value, name)


def _hints(cls: Any) -> dict[str, Any]:
    """Resolved hints of the constructor; where a name can't be resolved (an import under TYPE_CHECKING), the
    annotations as written."""
    init = cls.__init__ if inspect.isclass(cls) else cls
    try:
        return typing.get_type_hints(init)
    except Exception:  # NameError and whatever a forward reference raises
        return dict(getattr(init, "__annotations__", {}))


def _options(hint: Any) -> list[Any]:
    """The alternatives of a hint (X | Y, Optional[X], Union[...]); [] when there is no hint."""
    if hint is inspect.Parameter.empty or hint is None:
        return []
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [o for a in args for o in _options(a)]
    return [hint]


def _spelled(option: Any) -> str:
    if isinstance(option, str):
        return option
    return getattr(option, "__name__", "") or repr(option)


def _is_callable(option: Any) -> bool:
    if isinstance(option, str):
        return option.startswith(("Callable", "collections.abc.Callable", "typing.Callable"))
    callables = (collections.abc.Callable, typing.Callable)
    return option in callables or typing.get_origin(option) is collections.abc.Callable


__all__ = ["KwargConverter", "ModelNames"]
