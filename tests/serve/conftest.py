"""A live local Ray Serve instance on a free loopback port with three apps on one tiny model.

- `main` at /: aimd admission, small limits, used by most tests.
- `auth` at /auth: the same, behind API keys read from a file, taking 48 requests at once.
- `held` at /held: a fixed window that holds requests (until its test switches the policy),
  a staging queue of 2 (for 429), and a 2 MiB body limit (a 1 MB prompt reaches the tokenizer).
All three give a request's body 3 s to arrive (408 beyond).

Ray runs in a fresh temporary directory, started once per test session of this folder
(`serve_instance`, which other apps share: `two_replicas`, two replicas behind the
prefix-routing front, deployed once for the tests of replicas, routing and metrics).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from actors.config import EngineConfig
from packing.admission import AdmissionConfig
from pipeline.serve.config import ServeConfig
from pipeline.serve.proxy_headers import PROXY_CALLBACK_VARIABLE, use_in_proxy
from tests.tiny_models import save_tiny_model

logger = logging.getLogger(__name__)

MODEL = "tiny"
API_KEY = "sk-test-123"
HOLD_S = 600.0  # never expires within a test: the 429 test releases by switching policy
BODY_TIMEOUT_S = 3.0  # a whole body within this (408 beyond)
HELD_MAX_BODY = 2 << 20
TWO_REPLICAS = "two-replicas"  # the app name of `two_replicas`


@dataclass(frozen=True)
class Live:
    """Where the live apps are."""

    base: str  # http://127.0.0.1:<port>
    model_dir: Path
    configs: dict[str, ServeConfig]  # app name -> what it was deployed with
    metrics_url: str  # Ray's Prometheus endpoint on this node

    def url(self, path: str, app: str = "") -> str:
        """The URL of `path` on `app` ('' for main, 'auth', 'held')."""
        prefix = f"/{app}" if app else ""
        return f"{self.base}{prefix}{path}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama with the SmolLM2 tokenizer (context 512)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def two_replica_args(model_dir: Path) -> dict[str, str]:
    """`serve run`-style string arguments of a two-replica app of the tiny model (0.1 CPU each:
    `two_replicas` stays up beside `live` and tests/serve/test_parallel.py's tp app, no API
    keys whatever the environment holds)."""
    return {
        "model": str(model_dir),
        "served_model_name": MODEL,
        "num_replicas": "2",
        "dtype": "float32",  # compared with HF float32
        "num_cpus": "0.1",
        "max_num_seqs": "8",
        "policy": "immediate",
        "api_keys_env": "",
    }


def serve_run_builder(args: dict[str, str]) -> Any:
    """What `serve run pipeline.serve:build_app k=v ...` does with its import path and
    arguments (ray/serve/scripts.py): import the attribute, call it as an app builder."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    return call_user_app_builder_with_args_if_necessary(
        import_attr("pipeline.serve:build_app"), args
    )


@dataclass(frozen=True)
class ServeInstance:
    """Where the session's Serve listens; apps are deployed on it by the fixtures that need them."""

    base: str  # http://127.0.0.1:<port>
    metrics_url: str  # Ray's Prometheus endpoint on this node


@pytest.fixture(scope="session")
def serve_instance() -> Iterator[ServeInstance]:
    """Start Ray (in a fresh temporary directory) and Serve on a free port, with no apps; shut
    both down after the session."""
    import ray
    from ray import serve

    # A short path: Ray's unix sockets live under it.
    temp_dir = tempfile.mkdtemp(prefix="rps", dir="/tmp")
    port, metrics_port = free_port(), free_port()
    # As `raypack serve` starts its Ray: Serve's proxy with our header filter (a non-ASCII
    # X-Request-ID was its text/plain 500; pipeline/serve/proxy_headers.py).
    set_here = use_in_proxy(os.environ)
    ray.init(
        num_cpus=2,
        _temp_dir=temp_dir,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield ServeInstance(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
            if set_here:
                os.environ.pop(PROXY_CALLBACK_VARIABLE, None)


@pytest.fixture(scope="session")
def live(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, serve_instance: ServeInstance
) -> Live:
    """Deploy the three apps on the session's Serve (they go when it shuts down)."""
    from ray import serve

    from pipeline.serve import build_app

    keys = tmp_path_factory.mktemp("keys") / "api_keys.txt"
    keys.write_text(f"# test keys\n{API_KEY}\nsk-other\n")
    started = time.monotonic()
    engine = EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=64)
    common = dict(
        engine=engine,
        served_model_name=MODEL,
        max_tokens_limit=400,
        num_cpus=0.2,
        api_keys_env=None,
        body_timeout_s=BODY_TIMEOUT_S,
    )
    aimd = AdmissionConfig(policy="aimd", max_wait_s=0.05, ttft_low_s=0.05, ttft_high_s=0.2)
    apps = {
        "main": ServeConfig(admission=aimd, max_body_bytes=16_384, **common),  # type: ignore[arg-type]
        "auth": ServeConfig(  # type: ignore[arg-type]
            admission=aimd,
            max_body_bytes=16_384,
            api_keys_file=str(keys),
            max_ongoing_requests=48,  # fewer than tests/serve/test_slow_clients.py holds
            **common,
        ),
        "held": ServeConfig(  # type: ignore[arg-type]
            admission=AdmissionConfig(policy="fixed", window_requests=100, window_s=HOLD_S),
            max_waiting=2,
            retry_after_s=3,
            max_body_bytes=HELD_MAX_BODY,  # room for a 1 MB prompt (tokenized, then a 400)
            **common,
        ),
    }
    serve.run_many(  # deployed side by side: each replica loads torch once
        [
            serve.RunTarget(build_app(config), name, "/" if name == "main" else f"/{name}")
            for name, config in apps.items()
        ]
    )
    live = Live(serve_instance.base, tiny_model_dir, apps, serve_instance.metrics_url)
    requests.get(live.url("/health"), timeout=10).raise_for_status()
    logger.info("live serve apps up in %.1f s", time.monotonic() - started)
    return live


@pytest.fixture(scope="session")
def two_replicas(serve_instance: ServeInstance, tiny_model_dir: Path) -> Iterator[str]:
    """ONE app of two replicas of the tiny model behind the prefix-routing front (the default
    with replicas), built from `two_replica_args` as `serve run` passes them; its base URL.
    Deployed once, for the tests of replicas, routing and metrics (test_replicas.py,
    test_routing.py, test_metrics_http.py): each of them starting its own took 17-26 s of
    setup in the suite. Tests on it count from what they see before them (it has served other
    tests' requests)."""
    from ray import serve

    serve.run(
        serve_run_builder(two_replica_args(tiny_model_dir)),
        name=TWO_REPLICAS,
        route_prefix=f"/{TWO_REPLICAS}",
    )
    try:
        yield f"{serve_instance.base}/{TWO_REPLICAS}"
    finally:
        serve.delete(TWO_REPLICAS)


@pytest.fixture(scope="session")
def reference_engine(tiny_model_dir: Path):  # noqa: ANN201
    """The same tiny model in this process, for batch `generate` references."""
    from actors import LLMEngine

    return LLMEngine(EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=64))
