"""Tokenizer and chat-template plumbing shared by the built-in workflows and the agents' recording proxy.

Token fidelity: generated tokens are never re-tokenized. A conversation grows by appending the engine's output ids
verbatim and tokenizing only the new turns' text (`continuation_ids`), rendered by the model's own chat template.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from rollq.engine.eos import model_eos_ids
from rollq.workers.model_names import check_job_model, job_model_dir

# A stand-in conversation: the template's rendering of new turns after an assistant turn is the difference between
# rendering it with and without them (the template renders turns independently of their neighbours' content).
_ANCHOR = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def load_tokenizer(name: str) -> Any:
    """ "tiny" (the offline test model) or "smollm2" (both built into the cache on first use), or an HF tokenizer
    directory; in a worker, only what its jobs may name (rollq.workers.model_names): the names built-in workflows
    get from a job's kwargs come through here."""
    from transformers import AutoTokenizer  # heavy import: only when a workflow or the proxy needs it

    return AutoTokenizer.from_pretrained(job_model_dir(name))


class StopTextDecoder:
    """`decode(ids) -> str` for the engine pool, which applies stop strings itself against engines launched with
    --skip-tokenizer-init. Special tokens are kept, as SGLang matches stop strings against the raw tail. The
    tokenizer loads on first use: only requests with stop strings need it."""

    def __init__(self, name: str) -> None:
        self.name = name

    @functools.cached_property
    def _tokenizer(self) -> Any:
        return load_tokenizer(self.name)

    def __call__(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=False)
        return text


class LazyTokenizer:
    """Loads once per workflow instance (the worker builds one instance per process), off the event loop; `loader`
    (default load_tokenizer) may load another thing by the model's name, e.g. its processor. The name is checked
    as it is given (`field`: the workflow kwarg it came from), so a job naming a model it may not is refused while
    its workflow is built (dead-lettered at once), not at its first episode."""

    def __init__(self, name: str, loader: Callable[[str], Any] | None = None, field: str = "tokenizer") -> None:
        check_job_model(name, field)
        self.name = name
        self._loader = loader or load_tokenizer
        self._tokenizer: Any = None
        self._lock: asyncio.Lock | None = None  # created inside the running loop

    async def get(self) -> Any:
        if self._tokenizer is None:
            self._lock = self._lock or asyncio.Lock()
            async with self._lock:
                if self._tokenizer is None:
                    self._tokenizer = await asyncio.to_thread(self._loader, self.name)
        return self._tokenizer


def encode(tokenizer: Any, text: str) -> list[int]:
    # The chat template already wrote every special token; don't let the tokenizer add a BOS of its own.
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer: skip ~50 µs of Python wrapping
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=False).ids)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    text: str = tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return text


def prompt_ids(tokenizer: Any, data: dict[str, Any], *, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The episode's prompt tokens from `data`: `messages` (chat), `prompt` (a user message) or `input_ids`."""
    if data.get("input_ids") is not None:
        return [int(t) for t in data["input_ids"]]
    if data.get("messages") is not None:
        messages = list(data["messages"])
    elif data.get("prompt") is not None:
        messages = [{"role": "user", "content": str(data["prompt"])}]
    else:
        raise ValueError("data needs 'messages', 'prompt' or 'input_ids'")
    return encode(tokenizer, render(tokenizer, messages, tools=tools, add_generation_prompt=True))


def anchor_text(tokenizer: Any) -> str:
    """The stand-in conversation rendered (callers on a hot path compute it once and pass it as `base`)."""
    return render(tokenizer, _ANCHOR)


def continuation_ids(
    tokenizer: Any, last_output: list[int], messages: list[dict[str, Any]], base: str | None = None
) -> list[int]:
    """Tokens that close the assistant turn ending in `last_output` and add `messages`, then open the next
    assistant turn (the generation prompt)."""
    return encode(tokenizer, continuation_text(tokenizer, last_output, messages, base))


def continuation_text(
    tokenizer: Any, last_output: list[int], messages: list[dict[str, Any]], base: str | None = None
) -> str:
    """continuation_ids' text, before it is tokenized (a processor expands the image placeholders of new turns with
    images while tokenizing it)."""
    base = base if base is not None else anchor_text(tokenizer)
    full = render(tokenizer, _ANCHOR + messages, add_generation_prompt=True)
    if not full.startswith(base):
        raise ValueError("the chat template does not render new turns as a suffix of the conversation")
    closing = base[base.rindex("a") + 1 :]  # what the template writes after assistant content, e.g. "<|im_end|>\n"
    # A turn that stopped on the end-of-turn token already holds that token: add only the rest of the closing text.
    # A turn cut off by length gets the whole closing text (masked: the model did not write it).
    if last_output and last_output[-1] in _eos_ids(tokenizer):
        eos_text = tokenizer.decode([last_output[-1]])
        if closing.startswith(eos_text):
            closing = closing[len(eos_text) :]
    return closing + full[len(base) :]


def _eos_ids(tokenizer: Any) -> set[int]:
    ids = tokenizer.eos_token_id
    return set(ids) if isinstance(ids, list) else {ids} if ids is not None else set()


@functools.lru_cache(maxsize=16)
def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """Ids that end a reply: the tokenizer's eos, generation_config.json's eos ids, and the chat template's
    end-of-turn token (`<|im_end|>`). Sent explicitly in every request: SGLang applies the last two only with its
    tokenizer loaded (not with --skip-tokenizer-init), and other servers may know none of them."""
    ids = model_eos_ids(tokenizer, getattr(tokenizer, "name_or_path", None))
    try:  # what the template writes after assistant content, e.g. "<|im_end|>\n": its first token if special
        base = anchor_text(tokenizer)
        closing = encode(tokenizer, base[base.rindex("a") + 1 :])[:1]
    except Exception:  # no chat template: nothing to add
        closing = []
    special = set(tokenizer.get_added_vocab().values()) | set(getattr(tokenizer, "all_special_ids", []))
    ids += [t for t in closing if t in special]
    return tuple(dict.fromkeys(int(t) for t in ids))  # first occurrence order, no repeats


__all__ = [
    "LazyTokenizer",
    "anchor_text",
    "continuation_ids",
    "continuation_text",
    "encode",
    "load_tokenizer",
    "prompt_ids",
    "render",
    "stop_token_ids",
]
