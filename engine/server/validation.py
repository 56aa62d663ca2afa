"""Parsing and validating SGLang /generate bodies into typed prompts and sampling params (SGLang's rules and messages,
see docs/sglang-protocol.md). Two error kinds, because SGLang answers them in two shapes."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from rollq.engine.types import SamplingParams


class BadRequest(Exception):
    """Request-shape error: 400 `{"object":"error","message":...,"type":"Bad Request","param":null,"code":400}`."""


class EngineValueError(Exception):
    """What SGLang's engine raises as ValueError: 400 `{"error":{"message":...}}`."""


SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)
# SGLang sampling keys rollq's engines accept and ignore (constrained decoding, seeds, ...): real clients send them.
IGNORED_SAMPLING_KEYS = frozenset(
    {
        "stop_regex",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "spaces_between_special_tokens",
        "custom_params",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
    }
)


class Prompt(msgspec.Struct, kw_only=True):
    """One prompt of a (possibly batched) /generate call, with its samples' rids (n of them)."""

    input_ids: list[int]
    params: SamplingParams
    rids: list[str]
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int
    priority: int | None = None  # SGLang's request priority (larger first in the reference scheduler)
    lora_path: str | None = None  # the LoRA adapter's NAME (SGLang's field name), None: the base model
    image_data: list[str] = []  # SGLang's image_data of this prompt, as given (engine/server/media.py loads them)


class GenerateCall(msgspec.Struct, kw_only=True):
    prompts: list[Prompt]
    batched: bool  # answer a JSON list (batch input or n > 1)
    stream: bool
    return_text_in_logprobs: bool


def parse_sampling(raw: Any) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be an object or a list of objects")
    unknown = sorted(k for k in raw if k not in SAMPLING_FIELDS and k not in IGNORED_SAMPLING_KEYS)
    if unknown:
        raise EngineValueError(f"Unknown sampling parameter(s): {', '.join(map(str, unknown))}")
    given = {k: v for k, v in raw.items() if k in SAMPLING_FIELDS and v is not None}  # null means default
    if isinstance(given.get("stop"), str):
        given["stop"] = [given["stop"]]
    try:
        params = msgspec.convert(given, SamplingParams)
    except msgspec.ValidationError as exc:
        raise EngineValueError(f"Invalid sampling_params: {exc}") from None
    verify(params)
    return params


def verify(p: SamplingParams) -> None:
    """SGLang's SamplingParams.verify() ranges and messages."""
    if p.temperature < 0.0:
        raise EngineValueError(f"temperature must be non-negative, got {p.temperature}.")
    if not 0.0 < p.top_p <= 1.0:
        raise EngineValueError(f"top_p must be in (0, 1], got {p.top_p}.")
    if not 0.0 <= p.min_p <= 1.0:
        raise EngineValueError(f"min_p must be in [0, 1], got {p.min_p}.")
    if p.top_k < 1 and p.top_k != -1:
        raise EngineValueError(f"top_k must be -1 (disable), or at least 1, got {p.top_k}.")
    if not -2.0 <= p.frequency_penalty <= 2.0:
        raise EngineValueError(f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}.")
    if not -2.0 <= p.presence_penalty <= 2.0:
        raise EngineValueError(f"presence_penalty must be in [-2, 2], got {p.presence_penalty}.")
    if not 0.0 < p.repetition_penalty <= 2.0:
        raise EngineValueError(f"repetition_penalty must be in (0, 2], got {p.repetition_penalty}.")
    if p.min_new_tokens < 0:
        raise EngineValueError(f"min_new_tokens must be in [0, max_new_tokens], got {p.min_new_tokens}.")
    if p.max_new_tokens < 0:
        raise EngineValueError(f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
    if p.min_new_tokens > p.max_new_tokens:
        raise EngineValueError(
            f"min_new_tokens must be in [0, max_new_tokens({p.max_new_tokens})], got {p.min_new_tokens}."
        )
    if p.n < 1:
        raise EngineValueError(f"n must be at least 1, got {p.n}.")


def _is_int(x: Any) -> bool:
    return type(x) is int


def _prompts_from_ids(raw: Any) -> tuple[list[list[int]], bool]:
    if not isinstance(raw, list):
        raise BadRequest("input_ids must be a list of token ids or a list of such lists")
    if not raw:
        raise EngineValueError("input_ids cannot be empty.")
    if all(map(_is_int, raw)):
        return [raw], False
    if all(isinstance(x, list) for x in raw):
        for ids in raw:
            if not ids:
                raise EngineValueError("input_ids cannot be empty.")
            if not all(map(_is_int, ids)):
                raise BadRequest("input_ids must contain integers")
        return raw, True
    raise BadRequest("input_ids must be a list of token ids or a list of such lists")


def _per_prompt(value: Any, count: int, name: str, default: Any, kind: type | tuple[type, ...]) -> list[Any]:
    """SGLang lets most per-request fields be a scalar (applies to all) or a list (one per prompt)."""
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise EngineValueError(f"{name} has {len(value)} entries for {count} prompts")
        items = [default if v is None else v for v in value]
    else:
        items = [value] * count
    if not all(isinstance(v, kind) for v in items):
        raise BadRequest(f"{name} has the wrong type")
    return items


def parse_generate(body: Any, *, encode, vocab_size: int, context_length: int, tokenizer: bool) -> GenerateCall:
    """`encode(text) -> ids`; raises BadRequest / EngineValueError with SGLang's messages."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    given = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
    if not given:
        raise EngineValueError("Either text, input_ids or input_embeds should be provided.")
    if len(given) > 1:
        raise EngineValueError("Only one of text, input_ids, or input_embeds should be provided.")
    if given[0] == "input_embeds":
        raise EngineValueError("input_embeds is not supported by this engine.")
    if given[0] == "text":
        if not tokenizer:
            raise EngineValueError("text input needs a tokenizer; this server runs with --skip-tokenizer-init.")
        text = body["text"]
        if isinstance(text, str):
            texts, batched = [text], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            texts, batched = text, True
        else:
            raise BadRequest("text must be a string or a non-empty list of strings")
        prompts_ids = [encode(t) for t in texts]
        if any(not ids for ids in prompts_ids):
            raise EngineValueError("input_ids cannot be empty.")
    else:
        prompts_ids, batched = _prompts_from_ids(body["input_ids"])
    count = len(prompts_ids)

    raw_sampling = body.get("sampling_params")
    if isinstance(raw_sampling, list):
        if len(raw_sampling) != count:
            raise EngineValueError(f"sampling_params has {len(raw_sampling)} entries for {count} prompts")
        params = [parse_sampling(s) for s in raw_sampling]
    else:
        one = parse_sampling(raw_sampling)
        params = [one] * count

    rid = body.get("rid")
    base_rids: list[str | None]
    if rid is None:
        base_rids = [None] * count
    elif isinstance(rid, str):
        base_rids = [f"{rid}_{i}" for i in range(count)] if batched else [rid]
    elif isinstance(rid, list) and len(rid) == count and all(isinstance(r, str) for r in rid):
        base_rids = list(rid)
    else:
        raise EngineValueError("rid must be a string or a list of strings, one per prompt")

    return_logprob = _per_prompt(body.get("return_logprob"), count, "return_logprob", False, bool)
    top_logprobs = _per_prompt(body.get("top_logprobs_num"), count, "top_logprobs_num", 0, int)
    start_len = _per_prompt(body.get("logprob_start_len"), count, "logprob_start_len", -1, int)
    lora_paths = _lora_paths(body.get("lora_path"), count)
    images = _image_data(body.get("image_data"), count, batched)
    priority = body.get("priority")
    if priority is not None and type(priority) is not int:
        raise BadRequest("priority must be an integer")
    stream = body.get("stream") or False
    text_in_logprobs = body.get("return_text_in_logprobs") or False
    if not isinstance(stream, bool) or not isinstance(text_in_logprobs, bool):
        raise BadRequest("stream and return_text_in_logprobs must be booleans")

    prompts: list[Prompt] = []
    for i, ids in enumerate(prompts_ids):
        p = params[i]
        if not tokenizer:
            _refuse_tokenizer_features(p)
        if vocab_size and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = next(t for t in ids if t < 0 or t >= vocab_size)
            raise EngineValueError(f"Input token id {bad} is out of the vocabulary range [0, {vocab_size}).")
        # tokenizer_manager.py:1337-1377: input >= context is refused; input + max_new_tokens > context too, but only
        # when the client set max_new_tokens itself.
        if context_length and len(ids) >= context_length:
            raise EngineValueError(
                f"The input ({len(ids)} tokens) is longer than the model's context length ({context_length} tokens)."
            )
        if context_length and _explicit_max(raw_sampling, i) and (p.max_new_tokens + len(ids) > context_length):
            raise EngineValueError(
                f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
                f"You requested a total of {p.max_new_tokens + len(ids)} tokens: {len(ids)} tokens from the input "
                f"messages and {p.max_new_tokens} tokens for the completion. Please reduce the number of tokens in "
                "the input messages or the completion to fit within the limit."
            )
        if p.n > 1:  # every sample of a parallel-sampling request gets a fresh rid
            rids = [uuid.uuid4().hex for _ in range(p.n)]
        else:
            rids = [base_rids[i] or uuid.uuid4().hex]
        prompts.append(
            Prompt(
                input_ids=ids,
                params=p,
                rids=rids,
                return_logprob=return_logprob[i],
                top_logprobs_num=top_logprobs[i],
                logprob_start_len=start_len[i],
                priority=priority,
                lora_path=lora_paths[i],
                image_data=images[i],
            )
        )
    return GenerateCall(
        prompts=prompts,
        batched=batched or sum(len(p.rids) for p in prompts) > 1,
        stream=stream,
        return_text_in_logprobs=text_in_logprobs,
    )


def _image_data(raw: Any, count: int, batched: bool) -> list[list[str]]:
    """`image_data` per prompt (io_struct.py's MultimodalDataInputFormat, string forms): one prompt takes a string or
    a list of strings (one per image placeholder, in order); a batch takes a list with one entry per prompt, each a
    string, a list of strings or null."""
    if raw is None:
        return [[] for _ in range(count)]
    if not batched:
        items = [raw] if isinstance(raw, str) else raw
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise BadRequest("image_data must be a string or a list of strings (base64, a data URI, a path or a URL)")
        return [list(items)]
    if not isinstance(raw, list) or len(raw) != count:
        raise EngineValueError(f"image_data of a batch needs one entry per prompt ({count})")
    out: list[list[str]] = []
    for entry in raw:
        items = [] if entry is None else [entry] if isinstance(entry, str) else entry
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise BadRequest("each prompt's image_data must be a string, a list of strings or null")
        out.append(list(items))
    return out


def _lora_paths(raw: Any, count: int) -> list[str | None]:
    """`lora_path`: one adapter name for every prompt, or a list with one per prompt (None / "" = the base model);
    io_struct.py:381-389 in 0.5.5."""
    if raw is None or isinstance(raw, str):
        return [raw or None] * count
    if not isinstance(raw, list):
        raise EngineValueError("lora_path should be a list or a string.")
    if len(raw) != count or not all(x is None or isinstance(x, str) for x in raw):
        raise EngineValueError(f"lora_path has {len(raw)} entries for {count} prompts: one name (or null) each")
    return [x or None for x in raw]


def _refuse_tokenizer_features(p: SamplingParams) -> None:
    """Without a tokenizer (--skip-tokenizer-init) stop strings and min_new_tokens are refused
    (sampling/sampling_params.py:440-467 in 0.5.23; 0.5.5's scheduler crashes on them instead)."""
    if p.stop:
        raise EngineValueError(
            f"stop={p.stop!r} is unavailable when skip_tokenizer_init=True "
            "(requires tokenizer to decode tokens to text for matching)."
        )
    if p.min_new_tokens > 0:
        raise EngineValueError(
            f"min_new_tokens={p.min_new_tokens} is unavailable when skip_tokenizer_init=True "
            "(requires tokenizer for eos_token_id)."
        )


def _explicit_max(raw_sampling: Any, i: int) -> bool:
    """SGLang checks the total length only when the client set max_new_tokens itself."""
    item = raw_sampling[i] if isinstance(raw_sampling, list) else raw_sampling
    return isinstance(item, dict) and item.get("max_new_tokens") is not None
