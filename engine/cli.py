"""`rollq engine`: serve SGLang's HTTP protocol over a synthetic, reference (transformers) or SGLang backend."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from engine.backend import Backend
from engine.server import EngineServerConfig, serve

log = logging.getLogger("rollq.engine")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["synthetic", "reference", "sglang"], default="synthetic")
    p.add_argument("--model", default="tiny", help="model: `tiny` or a path (reference/sglang backends)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (not on /health*, /metrics)")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--skip-tokenizer-init", action="store_true", help="token ids only: no `text` in or out")
    p.add_argument("--device", default="cpu", help="torch device of the reference backend (default cpu)")
    p.add_argument("--max-running", type=int, default=0, help="batch slots (0 = the backend's default)")
    p.add_argument("--register", action="store_true",
                   help="register in the run's Redis engine registry (--redis, --run) so workers find this engine")
    p.add_argument("--advertise-url", default=None, metavar="URL",
                   help="URL workers should use (default: http://HOST:PORT; set it when binding 0.0.0.0)")
    g = p.add_argument_group("synthetic backend")
    g.add_argument("--token-latency", type=float, default=0.0, metavar="S", help="seconds per decode step")
    g.add_argument("--request-latency", type=float, default=0.0, metavar="S", help="seconds of prefill per request")
    g.add_argument("--length-dist", default="fixed", metavar="SPEC",
                   help="output lengths: fixed[:N] | uniform:LOW:HIGH | lognormal:MEDIAN:SIGMA | pareto:XMIN:ALPHA")
    g.add_argument("--seed", type=int, default=0)


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("engine", parents=[common], help="serve an inference engine speaking SGLang's HTTP protocol")
    add_arguments(p)
    p.set_defaults(handler=run_engine)


def build_backend(args: argparse.Namespace) -> Backend:
    """Raises SystemExit(2) with a one-line message when the backend is unavailable."""
    if args.backend == "synthetic":
        from engine.synthetic import LengthDist, SyntheticBackend, SyntheticConfig

        try:
            length = LengthDist.parse(args.length_dist)
        except ValueError as exc:
            raise _usage_exit(str(exc)) from None
        return SyntheticBackend(SyntheticConfig(
            model_path=args.model if args.model != "tiny" else "synthetic",
            per_token_latency_s=args.token_latency,
            per_request_latency_s=args.request_latency,
            length=length,
            seed=args.seed,
            max_running_requests=args.max_running,
        ))
    if args.backend == "reference":
        try:
            from engine import reference
        except ImportError as exc:
            raise _usage_exit(f"the reference backend is unavailable: {exc}") from None
        build = getattr(reference, "build_backend", None)  # reference.py may own its own args -> Backend mapping
        if build is not None:
            return build(args)
        fields: dict = {"model": args.model, "device": args.device, "seed": args.seed}
        if args.max_running:
            fields["max_running"] = args.max_running
        return reference.ReferenceBackend(reference.ReferenceConfig(**fields))
    raise _usage_exit("the sglang backend is not implemented yet")


def _usage_exit(message: str) -> SystemExit:
    print(f"rollq engine: {message}", file=sys.stderr)
    return SystemExit(2)


async def _serve(backend: Backend, config: EngineServerConfig, args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    handle = await serve(backend, config)
    log.info("engine (%s) serving on %s, weight version %s", type(backend).__name__, handle.url,
             config.weight_version)
    registration = None
    if getattr(args, "register", False):
        from engine.registry import EngineRegistry
        from protocol.connection import redis_client, redis_url_from_env

        redis = redis_client(redis_url_from_env(getattr(args, "redis", None)))
        await redis.ping()  # fail now, in one clear line, if Redis is unreachable
        url = args.advertise_url or handle.url
        registration = asyncio.create_task(EngineRegistry(redis, getattr(args, "run", "default")).keep_registered(url))
        log.info("registered as %s in run %r", url, getattr(args, "run", "default"))
    await stop.wait()
    log.info("shutting down: aborting requests in flight")
    if registration is not None:
        registration.cancel()
        await asyncio.gather(registration, return_exceptions=True)
    await handle.close()
    return 0


def run_engine(args: argparse.Namespace) -> int:
    try:
        backend = build_backend(args)
    except SystemExit as exc:
        return int(exc.code or 2)
    config = EngineServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                                weight_version=args.weight_version, skip_tokenizer_init=args.skip_tokenizer_init)
    try:
        import uvloop

        return uvloop.run(_serve(backend, config, args))
    except ImportError:
        return asyncio.run(_serve(backend, config, args))
