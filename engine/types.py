"""Typed messages of the engine layer: SGLang's sampling params and finish reasons, and AReaL's
ModelRequest/ModelResponse handed to workflows."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any, Literal, Protocol

import msgspec

log = logging.getLogger("rollq.engine")
PauseMode = Literal["abort", "retract", "in_place"]

# The control routes: SGLang 0.5.23 guards them with --admin-api-key when one is set, else with --api-key (the decision
# in utils/auth.py:128-143; open only when neither key is set). Every one is `@auth_level(AuthLevel.ADMIN_OPTIONAL)` in
# sglang-0.5.23 entrypoints/http_server.py: /flush_cache :1025-1026, /update_weights_from_disk :1300-1301,
# /init_weights_update_group :1404-1405, /destroy_weights_update_group :1420-1421, /update_weights_from_tensor
# :1436-1437, /begin_weight_update :1458-1459, /end_weight_update :1473-1474, /update_weights_from_distributed
# :1488-1489, /update_weight_version :1527-1528, /abort_request :1721-1722, /pause_generation :1831-1832,
# /continue_generation :1844-1845. The distributed ones make the engine join a process group at any master_address
# and take weights from its rank 0, so they need the admin key as much as a disk load does. Routes rollq's engine
# serves besides these (/generate, /model_info, /server_info, /v1/models, 0.5.5's /get_*) are NORMAL there: the api
# key; /health*, /ready, /metrics are open (utils/auth.py:101-106). 0.5.5.post3 has only --api-key, on every route
# but /health* and /metrics (utils/common.py:1123-1134). Client and server share the list.
ADMIN_ROUTES = frozenset(
    {
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/flush_cache",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        # rollq's weight-delta routes (engine/server/delta_routes.py); plain SGLang answers 404
        "/rollq/prepare_weights",
        "/rollq/swap_prepared_weights",
        "/rollq/weights_checksum",
    }
)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """SGLang's sampling params (the subset rollq relies on; defaults as in SGLang)."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # below 1e-6: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    min_p: float = 0.0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def to_request(self) -> dict[str, Any]:
        """The `sampling_params` body: non-default keys, plus the values the trainer relies on always (a server's
        `--preferred-sampling-params` fills in keys a request omits, so an omitted temperature may not be 1.0)."""
        body: dict[str, Any] = msgspec.to_builtins(self)
        for key in EXPLICIT_SAMPLING_KEYS:
            body[key] = getattr(self, key)
        return body


# Always sent, whatever their value (see SamplingParams.to_request).
EXPLICIT_SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p")


class FinishReason(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`{"type": "stop", "matched": id|str}` | `{"type": "length", "length": N}` |
    `{"type": "abort", "message": ...}`."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None


class GenerateResult(msgspec.Struct, kw_only=True):
    """One parsed /generate answer (one sample)."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]  # logprob of each output token; empty when not requested
    finish_reason: FinishReason | None
    weight_version: str = "default"
    prompt_tokens: int = 0
    text: str | None = None
    meta_info: dict[str, Any] = {}

    @property
    def aborted(self) -> bool:
        return self.finish_reason is not None and self.finish_reason.type == "abort"


# AReaL's top_k default (int(1e8)): "the whole vocabulary"; SGLang spells that -1.
_WHOLE_VOCAB_TOP_K = int(1e8)

# Settings an OpenAI request has no argument for (AReaL's list; `max_tokens` is the prompt + output budget here).
_OPENAI_UNSUPPORTED = frozenset(
    {
        "min_new_tokens",
        "greedy",
        "top_k",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "lora_name",
        "use_beam_search",
        "max_tokens",
    }
)


@dataclasses.dataclass
class GenerationHyperparameters:
    """AReaL's generation settings (`areal.api.cli_args.GenerationHyperparameters`: same field names, defaults and
    helpers), accepted by `ModelRequest(gconfig=...)` and turned into SGLang's SamplingParams there."""

    n_samples: int = 1  # per request it must be 1 (as in AReaL): a group is n jobs, each its own episode
    max_new_tokens: int = 16384
    min_new_tokens: int = 0
    max_tokens: int = 32768  # prompt + generated tokens
    greedy: bool = False
    top_p: float = 1.0
    top_k: int = _WHOLE_VOCAB_TOP_K
    temperature: float = 1.0
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop: list[str] | None = None
    frequency_penalty: float = 0.0
    lora_name: str = "default_lora"
    use_beam_search: bool = False

    def new(self, **kwargs: Any) -> GenerationHyperparameters:
        """A copy with `kwargs` changed."""
        return GenerationHyperparameters(**{**dataclasses.asdict(self), **kwargs})

    def new_with_stop_and_pad_token_ids(self, tokenizer: Any) -> GenerationHyperparameters:
        """A copy that also stops on the tokenizer's pad and eos tokens (AReaL's helper; None ids are skipped)."""
        ids = list(self.stop_token_ids)
        for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
            if token_id is not None and token_id not in ids:
                ids.append(token_id)
        return self.new(stop_token_ids=ids)

    def to_openai_args_dict(
        self, exclude_args: list[str] | None = None, api_format: str = "completions"
    ) -> dict[str, Any]:
        """These settings as an OpenAI client's request arguments (AReaL's helper): `n_samples` -> `n`,
        `max_new_tokens` -> `max_completion_tokens` (completions), `max_output_tokens` (responses) or `max_tokens`
        (openai-agents' ModelSettings). Fields OpenAI has no argument for are left out, with a warning when set."""
        renamed = {
            "completions": "max_completion_tokens",
            "responses": "max_output_tokens",
            "openai-agents": "max_tokens",
        }
        if api_format not in renamed:
            raise ValueError(f"Unsupported API format: {api_format} (one of {', '.join(renamed)})")
        names = {"n_samples": "n", "max_new_tokens": renamed[api_format]}
        excluded = set(exclude_args or ()) | _OPENAI_UNSUPPORTED
        defaults = GenerationHyperparameters()
        args: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in excluded:
                if value != getattr(defaults, field.name):
                    log.warning("Unsupported arg for openai format: `%s` with value %s", field.name, value)
                continue
            args[names.get(field.name, field.name)] = value
        return args

    def to_openai_completions_args_dict(self, exclude_args: list[str] | None = None) -> dict[str, Any]:
        return self.to_openai_args_dict(exclude_args, "completions")

    def to_openai_responses_args_dict(self, exclude_args: list[str] | None = None) -> dict[str, Any]:
        return self.to_openai_args_dict(exclude_args, "responses")

    def to_openai_agents_model_settings_dict(self, exclude_args: list[str] | None = None) -> dict[str, Any]:
        return self.to_openai_args_dict(exclude_args, "openai-agents")

    def sampling_params(self, prompt_len: int) -> SamplingParams:
        """SGLang's sampling params for a prompt of `prompt_len` tokens, as AReaL's remote engine builds them:
        max_new_tokens = min(max_new_tokens, max_tokens - prompt_len); greedy = temperature 0."""
        if self.n_samples != 1:
            raise ValueError(
                f"gconfig.n_samples is {self.n_samples}; a request generates one sample (as in AReaL): use "
                "gconfig.new(n_samples=1) and submit n jobs (Job.n) or call agenerate n times"
            )
        if self.use_beam_search:
            raise ValueError("gconfig.use_beam_search is not supported (SGLang has no beam search)")
        max_new = min(self.max_new_tokens, self.max_tokens - prompt_len)
        if max_new <= 0:
            raise ValueError(
                f"max_new_tokens ({max_new}) is non-positive: max_tokens={self.max_tokens}, prompt_len={prompt_len}, "
                f"max_new_tokens={self.max_new_tokens}"
            )
        return SamplingParams(
            max_new_tokens=max_new,
            min_new_tokens=self.min_new_tokens,
            temperature=0.0 if self.greedy else self.temperature,
            top_p=self.top_p,
            top_k=-1 if self.top_k >= _WHOLE_VOCAB_TOP_K or self.top_k <= 0 else self.top_k,
            stop=list(self.stop) if self.stop else None,
            stop_token_ids=list(self.stop_token_ids) or None,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            frequency_penalty=self.frequency_penalty,
        )


class ModelRequest(msgspec.Struct, kw_only=True):
    """What a workflow asks the engine pool for (AReaL's name). `affinity` keeps every turn of an episode and every
    sample of a group on one engine while it is healthy (prefix-cache reuse); default: the rid.

    Give `sampling` (SGLang's params) or AReaL's `gconfig` (GenerationHyperparameters, converted to `sampling` here);
    `tokenizer` is accepted as in AReaL and not used by the engine pool."""

    input_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    rid: str = ""
    affinity: str = ""
    priority: int | None = None  # SGLang's top-level `priority` (with --enable-priority-scheduling); None: omitted
    lora_path: str | None = None  # the LoRA adapter's name (SGLang's `lora_path`); None: the engine's own weights
    # SGLang's `image_data`, one per image placeholder in input_ids, in order: base64 or a data URI (AReaL's
    # image2base64 form), or a path / URL where the engine allows them (docs/images.md)
    image_data: list[str] | None = None
    metadata: dict[str, Any] = {}
    # AReaL's vision fields, accepted so its files construct requests unchanged: the HF processor (handed back on
    # the response) and the chat messages AReaL's vLLM client sends instead of ids (SGLang's API needs neither)
    processor: Any = None
    vision_msg_vllm: list[Any] | None = None
    gconfig: GenerationHyperparameters | None = None
    tokenizer: Any = None

    def __post_init__(self) -> None:
        if self.gconfig is not None:
            if self.sampling != SamplingParams():
                raise ValueError("ModelRequest takes sampling= or gconfig=, not both")
            self.sampling = self.gconfig.sampling_params(len(self.input_ids))

    def copy(self) -> ModelRequest:
        """A copy whose lists and gconfig are the copy's own (AReaL's `ModelRequest.copy`)."""
        dup = copy.copy(self)  # not structs.replace: __post_init__ would see both sampling and gconfig
        dup.input_ids, dup.metadata = list(self.input_ids), dict(self.metadata)
        dup.image_data = None if self.image_data is None else list(self.image_data)
        dup.gconfig = None if self.gconfig is None else self.gconfig.new()
        return dup


def as_model_request(req: Any) -> ModelRequest:
    """rollq's ModelRequest for any request of its shape: AReaL's own `areal.api.ModelRequest` (a dataclass with
    rid, input_ids, gconfig, metadata, tokenizer, image_data...) when a workflow imports AReaL itself. rollq's routing
    fields (sampling, affinity, priority) are optional on it. `image_data` goes to the engines as SGLang's field;
    `vision_msg_vllm` (the chat messages AReaL's vLLM client sends instead) is not needed by SGLang's API."""
    if isinstance(req, ModelRequest):
        return req
    input_ids = getattr(req, "input_ids", None)
    if input_ids is None:
        raise TypeError(f"a model request needs input_ids; got {type(req).__name__}")
    image_data = getattr(req, "image_data", None)
    if image_data is not None and not (
        isinstance(image_data, list | tuple) and all(isinstance(x, str) for x in image_data)
    ):
        raise TypeError("ModelRequest.image_data must be a list of strings (base64, a data URI, a path or a URL)")
    gconfig = getattr(req, "gconfig", None)
    if gconfig is not None and not isinstance(gconfig, GenerationHyperparameters):
        ours = {f.name for f in dataclasses.fields(GenerationHyperparameters)}
        gconfig = GenerationHyperparameters(**{k: v for k, v in vars(gconfig).items() if k in ours})
    sampling = getattr(req, "sampling", None)
    return ModelRequest(
        input_ids=list(input_ids),
        rid=str(getattr(req, "rid", "") or ""),
        affinity=str(getattr(req, "affinity", "") or ""),
        priority=getattr(req, "priority", None),
        metadata=dict(getattr(req, "metadata", None) or {}),
        gconfig=gconfig if sampling is None else None,
        sampling=sampling if sampling is not None else SamplingParams(),
        tokenizer=getattr(req, "tokenizer", None),
        image_data=list(image_data) if image_data else None,
        processor=getattr(req, "processor", None),
    )


class ModelResponse(msgspec.Struct, kw_only=True):
    """Tokens generated for a ModelRequest, across any pauses, weight updates and failovers (AReaL's name).

    `output_versions[i]` is the policy version that produced `output_tokens[i]` (-1 where the engine reports a
    version that is not an integer)."""

    input_tokens: list[int]
    output_tokens: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: Literal["stop", "length", "tool_calls", "abort"]  # tool_calls: set by a client that parsed some
    rid: str = ""
    engine: str = ""  # URL of the engine that finished it
    resubmissions: int = 0  # times it was resubmitted after an abort (pause) or a dead engine
    latency_s: float = 0.0
    # AReaL's fields: the request's tokenizer (for end_with_stop), time to first token and inter-token latencies
    # (inf / empty where not measured), and what rollq does not produce yet (images, MoE routing).
    tokenizer: Any = None
    ttft: float = math.inf
    itl: list[float] = []
    input_images: list[Any] = []
    processor: Any = None
    routed_experts: Any = None

    # AReaL's ModelResponse properties.
    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)

    @property
    def latency(self) -> float:
        return self.latency_s

    @property
    def end_with_stop(self) -> bool:
        """Whether the last output token is the tokenizer's eos or pad token (AReaL's property)."""
        if self.tokenizer is None:
            raise ValueError("tokenizer is None, cannot check end_with_stop")
        stops = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id} - {None}
        return bool(self.output_tokens) and self.output_tokens[-1] in stops

    @property
    def output_tokens_without_stop(self) -> list[int]:
        """The output without its trailing eos/pad tokens when generation stopped on one (AReaL's property)."""
        if self.stop_reason in ("length", "abort") or not self.output_tokens:
            return self.output_tokens
        if not self.end_with_stop:
            raise ValueError(
                f"output_tokens end with {self.output_tokens[-1]}, not eos or pad, but stop_reason is "
                f"{self.stop_reason}"
            )
        stops = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id} - {None}
        end = len(self.output_tokens)
        while end > 0 and self.output_tokens[end - 1] in stops:
            end -= 1
        if end == 0:
            raise ValueError("all output_tokens are eos or pad tokens; stripping them would leave no output")
        return self.output_tokens[:end]


# Called with each batch of newly generated (token ids, logprobs) while a streamed request runs.
ProgressCallback = Callable[[list[int], list[float]], None]


class InferenceEngine(Protocol):
    """What a workflow gets as `engine` (the EnginePool, or anything that generates the same way)."""

    async def agenerate(self, req: ModelRequest, on_tokens: ProgressCallback | None = None) -> ModelResponse:
        """Generate up to `req.sampling.max_new_tokens` tokens after `req.input_ids`."""
        ...
