"""Serve the engine online: an OpenAI-compatible API on Ray Serve, with admission control.

    raypack serve --host 127.0.0.1 --port 8000 --model smollm2 --policy aimd
    raypack serve --model /models/llama-8b --tensor-parallel-size 2   # tp x pp engine
    raypack serve --num-replicas 2 --num-cpus 0.5                    # two replicas
    raypack serve --min-replicas 1 --max-replicas 4                  # Serve's autoscaling

Starts a local Ray instance (or joins --address), serves until Ctrl-C or SIGTERM. `--port 0` picks a free
port and logs it. With tp x pp > 1 the replica reserves its engine's workers in its own
placement group (pipeline/serve/app.py). See README "Online serving" for curl and
openai-client examples.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
from collections.abc import Mapping

from pipeline.commands.cli import HelpFormatter
from pipeline.commands.console import quiet_ray_token_notice
from pipeline.commands.shutdown import shutdown_ray
from pipeline.serve.cli import add_app_arguments, serve_config_from_args
from pipeline.serve.config import prefix_routed
from pipeline.serve.fit import fit_to_cluster
from pipeline.serve.proxy_headers import use_in_proxy

logger = logging.getLogger("raypack.serve")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The serving flags."""
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="HTTP port; 0 picks a free one")
    parser.add_argument("--address", default=None, help="Ray cluster to join; default: local")
    parser.add_argument(
        "--ray-num-cpus", type=int, default=None, help="CPUs of a local Ray (default: all)"
    )
    add_app_arguments(parser)  # the same flags `serve run pipeline.serve:build_app` takes
    return parser


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    """The command line."""
    return build_parser(prog).parse_args(argv)


def free_port(host: str) -> int:
    """A TCP port on `host` that is free now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def local_ray_cpus(args: argparse.Namespace, environ: Mapping[str, str]) -> int | None:
    """The CPUs of the Ray `main` starts when it starts one with `--ray-num-cpus` (`ray.init`
    starts a local Ray for `--address local`, or for no address without RAY_ADDRESS); None
    when it joins a cluster or leaves the count to Ray (then the replicas are fitted once
    connected)."""
    joins = args.address not in (None, "local") or (
        args.address is None and bool(environ.get("RAY_ADDRESS"))
    )
    return None if joins else args.ray_num_cpus


def interrupt_on_signals() -> None:
    """SIGINT (Ctrl-C) and SIGTERM stop the server the same way (Serve and Ray shut down,
    exit 0). Ray's own SIGTERM handler, set by ray.init, would kill its processes without
    Serve's shutdown and exit 1. SIGINT is set too, not left to Python's default: a process
    started in the background by a non-interactive shell (a CI script, `cmd &`) inherits SIGINT
    ignored, and Python then raises no KeyboardInterrupt (the server never stopped)."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Start Ray and Serve, deploy the app, block until interrupted."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet_ray_token_notice()  # a clean start prints no warning (see its docstring)
    args = parse_args(argv, prog)
    try:
        config = serve_config_from_args(args)
    except ValueError as exc:
        logger.error("bad option: %s", exc)
        return 2
    cpus = local_ray_cpus(args, os.environ)
    if cpus is not None:  # replicas a local Ray of known CPUs cannot hold: refused before it starts
        try:
            fit_to_cluster(config, prefix_routed(config), cluster_cpus=cpus)
        except ValueError as exc:
            logger.error("%s", exc)
            return 2
    from actors.loader import checked_config

    try:  # an unknown model, or one the engine would run wrong, is refused before Ray starts
        engine = config.engine
        checked_config(
            engine.model,
            engine.trust_remote_code,
            engine.tensor_parallel_size,
            engine.pipeline_parallel_size,
        )
    except (ValueError, FileNotFoundError) as exc:
        logger.error("bad option: --model %s: %s", config.engine.model, exc)
        return 2
    import ray
    from ray import serve

    from pipeline.serve.app import build_app

    port = args.port or free_port(args.host)
    # Serve's proxy answers a non-UTF-8 X-Request-ID with a text/plain 500 before the app
    # sees it; a local Ray's proxy inherits this variable and drops such a header instead.
    use_in_proxy(os.environ)
    ray.init(address=args.address, num_cpus=args.ray_num_cpus, include_dashboard=False)
    try:  # replicas the cluster cannot hold: exit now, naming the flags (Serve would wait)
        config = fit_to_cluster(config, prefix_routed(config))
    except ValueError as exc:
        logger.error("%s", exc)
        shutdown_ray()
        return 2
    threads = "" if config.torch_threads is None else f", its engine {config.torch_threads} threads"
    logger.info("each replica takes %g CPUs%s", config.num_cpus, threads)
    interrupt_on_signals()
    try:  # an interrupt while starting stops as cleanly as one while serving
        serve.start(http_options={"host": args.host, "port": port})
        serve.run(build_app(config), name="raypack", route_prefix="/")
        logger.info(
            "serving %s at http://%s:%d/v1 (policy %s); Ctrl-C stops",
            config.model_name, args.host, port, config.admission.policy,
        )  # fmt: skip
        threading.Event().wait()
    except KeyboardInterrupt:
        logger.info("stopping")
    finally:
        serve.shutdown()
        shutdown_ray()  # on this thread, after a collection (pipeline/commands/shutdown.py)
    return 0
