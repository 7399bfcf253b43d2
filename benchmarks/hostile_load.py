"""Issue 18's bar, measured: normal requests plus slow-body connections from loopback; are
/health and the normal requests still answered within 5 s? Prints one JSON object.

    flock /tmp/raypack-bench.lock python benchmarks/hostile_load.py            # tiny model
    python benchmarks/hostile_load.py --model smollm2 --normal 600 --slow 500 --partial 500
    python benchmarks/hostile_load.py --max-queue-wait 1.5 --max-num-seqs 64 --json-out r.json

Starts Ray and Serve on a free loopback port with `--num-replicas` replicas (jobs/serve.py's
defaults unless flagged), then runs two phases on the same server: `baseline` (the normal requests alone) and
`hostile` (the same requests while `--slow` connections send headers promising 1000 bytes of
body and then 10 bytes, and `--partial` connections send half a request line and stop).
/health is polled every 100 ms throughout. Latencies are client-side, in seconds, of all
normal requests, of the 200s and of the rejections (429/503) apart. `--json-out` also writes the
JSON to a file (Ray may print after it on stdout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (random, 2 layers) or a model")
    parser.add_argument("--normal", type=int, default=600, help="concurrent normal requests")
    parser.add_argument("--slow", type=int, default=500, help="slow-body connections")
    parser.add_argument("--partial", type=int, default=0, help="half-header connections")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per normal request")
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs of each replica")
    parser.add_argument("--num-replicas", type=int, default=1, help="replicas of the app")
    parser.add_argument(
        "--no-prefix-routing", action="store_true", help="no routing front (replicas > 1)"
    )
    parser.add_argument(
        "--max-queue-wait",
        type=float,
        default=None,
        help="ServeConfig.max_queue_wait_s: shed (429) requests waiting longer (default: none)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="ServeConfig.max_waiting (default: --normal, at least 256: none turned away for it)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="requests each engine runs at once"
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="ServeConfig.max_queued_requests (Serve's back-pressure; default: the app's)",
    )
    parser.add_argument("--json-out", default=None, help="also write the JSON report here")
    return parser.parse_args()


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def summary(values: list[float]) -> dict[str, float]:
    """p50, p95, p99 and max of latencies."""
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {
        "n": len(ordered),
        "p50": round(statistics.median(ordered), 3),
        "p95": at(0.95),
        "p99": at(0.99),
        "max": round(ordered[-1], 3),
    }


def error_code(payload: bytes) -> str:
    """The OpenAI error code of an error body ('' for a success or a body not ours)."""
    try:
        return str(json.loads(payload).get("error", {}).get("code", ""))
    except (ValueError, AttributeError):
        return ""


async def slow_body(port: int, statuses: list[int]) -> None:
    """Headers promising 1000 bytes, 10 of them, then silence until the server answers."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"model": '
        )
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 120)
        statuses.append(int(line.split(b" ", 2)[1]) if line else 0)
        writer.close()
    except (OSError, TimeoutError, IndexError, ValueError):
        statuses.append(-1)


async def partial_headers(port: int, stop: asyncio.Event) -> None:
    """Half a request line, held open until the phase ends."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/compl")
        await writer.drain()
        await stop.wait()
        writer.close()
    except OSError:
        pass


async def phase(base: str, port: int, args: argparse.Namespace, hostile: bool) -> dict[str, Any]:
    """Fire the normal requests (with the hostile connections if asked); poll /health."""
    stop = asyncio.Event()
    health: list[float] = []
    health_errors = 0
    slow_statuses: list[int] = []
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def poll_health() -> None:
            nonlocal health_errors
            while not stop.is_set():
                start = time.monotonic()
                try:
                    async with session.get(f"{base}/health") as response:
                        await response.read()
                        health_errors += response.status != 200
                except aiohttp.ClientError:
                    health_errors += 1
                health.append(time.monotonic() - start)
                await asyncio.sleep(0.1)

        async def normal(i: int) -> tuple[int, float, str]:
            body = {"model": "served", "prompt": f"Request {i} says", "max_tokens": args.max_tokens}
            start = time.monotonic()
            try:
                async with session.post(f"{base}/v1/completions", json=body) as response:
                    payload = await response.read()
                    return response.status, time.monotonic() - start, error_code(payload)
            except aiohttp.ClientError as exc:
                return -1, time.monotonic() - start, type(exc).__name__

        poller = asyncio.create_task(poll_health())
        hostile_tasks: list[asyncio.Task[None]] = []
        if hostile:
            hostile_tasks += [
                asyncio.create_task(slow_body(port, slow_statuses)) for _ in range(args.slow)
            ]
            hostile_tasks += [
                asyncio.create_task(partial_headers(port, stop)) for _ in range(args.partial)
            ]
            await asyncio.sleep(0.5)  # the slow ones arrive first
        started = time.monotonic()
        results = await asyncio.gather(*(normal(i) for i in range(args.normal)))
        wall = time.monotonic() - started
        stop.set()
        await asyncio.gather(*hostile_tasks, return_exceptions=True)
        await poller
    statuses: dict[str, int] = {}
    for status, _, code in results:
        key = str(status) if status == 200 else f"{status} {code}"
        statuses[key] = statuses.get(key, 0) + 1
    slow_counts: dict[str, int] = {}
    for status in slow_statuses:
        slow_counts[str(status)] = slow_counts.get(str(status), 0) + 1
    return {
        "normal_statuses": statuses,
        "normal_latency_s": summary([latency for _, latency, _ in results]),
        "normal_200_latency_s": summary([latency for st, latency, _ in results if st == 200]),
        "normal_rejected_latency_s": summary(
            [latency for st, latency, _ in results if st in (429, 503)]
        ),
        "normal_wall_s": round(wall, 3),
        "health_latency_s": summary(health),
        "health_errors": health_errors,
        "slow_body_statuses": slow_counts,
    }


def main() -> int:
    """Start the server, run both phases, print the JSON."""
    args = parse_args()
    import ray
    from ray import serve

    from actors.config import EngineConfig
    from pipeline.serve import ServeConfig, build_app
    from pipeline.serve.replicas import Replicas

    model = args.model
    if model == "tiny":
        from tests.tiny_models import save_tiny_model

        model = str(save_tiny_model(Path(tempfile.mkdtemp(prefix="tiny")) / "model"))
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine = EngineConfig(model=model)
    if args.max_num_seqs is not None:
        engine = EngineConfig(model=model, max_num_seqs=args.max_num_seqs)
    config = ServeConfig(
        engine=engine,
        served_model_name="served",
        max_waiting=args.max_waiting or max(256, args.normal),  # default: no 429 for a full queue
        max_queued_requests=args.max_queued_requests,
        num_cpus=args.num_cpus,
        replicas=Replicas(num_replicas=args.num_replicas),
        prefix_routing=not args.no_prefix_routing,
        api_keys_env=None,
        max_queue_wait_s=args.max_queue_wait,
    )
    serve.run(build_app(config), name="raypack", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    try:
        load_before = os.getloadavg()
        baseline = asyncio.run(phase(base, port, args, hostile=False))
        hostile = asyncio.run(phase(base, port, args, hostile=True))
        report = {
            "model": args.model,
            "normal_requests": args.normal,
            "slow_body_connections": args.slow,
            "partial_header_connections": args.partial,
            "max_tokens": args.max_tokens,
            "max_queue_wait_s": args.max_queue_wait,
            "max_waiting": config.max_waiting,
            "max_num_seqs": config.engine.max_num_seqs,
            "serve_max_queued_requests": config.queued_limit,
            "serve_max_ongoing_requests": config.ongoing_limit,
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(),
            "baseline": baseline,
            "hostile": hostile,
        }
        print(json.dumps(report, indent=1))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(report, indent=1))
    finally:
        serve.shutdown()
        from pipeline.commands.shutdown import shutdown_ray

        shutdown_ray()  # collected first, on this thread (pipeline/commands/shutdown.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
