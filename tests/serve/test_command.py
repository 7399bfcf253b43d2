"""The serving command line itself (`python jobs/serve.py`, the same code as `raypack serve`)
as a user runs it: a subprocess on a free port with the tiny model saved to a temporary
folder, with one replica and with two. It answers /health, a greedy completion equals Hugging
Face `generate`, /metrics covers every replica, and SIGINT or SIGTERM makes it exit 0 and
release the port. Timeouts are hang guards only."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import free_port
from tests.serve.hf_reference import HFReference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"


def port_is_free(port: int) -> bool:
    """Whether a new server could listen on `port` now (SO_REUSEADDR, as servers bind: the
    closed connections' TIME_WAIT entries do not hold it, a listener does)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
        return True


def wait_port_free(port: int, guard_s: float = 60) -> bool:
    """Whether `port` becomes free (Ray's processes end just after the command exits)."""
    deadline = time.monotonic() + guard_s
    while not port_is_free(port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def wait_healthy(
    process: subprocess.Popen[bytes], base: str, log: Path, guard_s: float = 180
) -> None:
    """Wait until the command says it serves and /health answers 200; fail (showing the log)
    if the command exits first."""
    deadline = time.monotonic() + guard_s
    while True:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise AssertionError(f"the command exited early with {process.returncode}:\n{tail}")
        ready = "Ctrl-C stops" in log.read_text(errors="replace")  # serve.run returned
        try:
            if ready and requests.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except (requests.ConnectionError, requests.Timeout):
            pass  # not listening yet, or the proxy is up before the app
        assert time.monotonic() < deadline, "the server never became healthy"
        time.sleep(0.5)


@pytest.mark.parametrize(
    ("stop_signal", "replicas"),
    [(signal.SIGINT, 2), (signal.SIGTERM, 1)],
    ids=["SIGINT-2-replicas", "SIGTERM"],
)
def test_serve_command_serves_and_stops_cleanly(
    tiny_model_dir: Path, tmp_path: Path, stop_signal: signal.Signals, replicas: int
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    command = [
        sys.executable,
        str(REPO / "jobs" / "serve.py"),
        "--model", str(tiny_model_dir), "--dtype", "float32",
        "--served-model-name", "tiny",
        "--port", str(port),
        "--address", "local",  # its own Ray, never one a test session started
        "--ray-num-cpus", "2",
        "--num-cpus", "0.2",
        "--max-num-seqs", "8",
        "--num-replicas", str(replicas),
    ]  # fmt: skip
    log = (tmp_path / "serve.log").open("wb")
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=log)
    try:
        wait_healthy(process, base, tmp_path / "serve.log")
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
        answer = requests.post(f"{base}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        expected = HFReference(tiny_model_dir).greedy(PROMPT, 10)
        assert answer.json()["choices"][0]["text"] == expected.text
        assert answer.json()["usage"]["prompt_tokens"] == expected.num_prompt_tokens
        metrics = requests.get(f"{base}/metrics", timeout=60)  # over every replica
        assert metrics.status_code == 200, metrics.text
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(metrics.text)
            for sample in family.samples
        }
        assert samples["raypack:time_to_first_token_seconds_count"] == 1
        assert samples["raypack:num_replicas"] == replicas

        process.send_signal(stop_signal)
        returncode = process.wait(timeout=120)  # hang guard
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
    output = (tmp_path / "serve.log").read_text(errors="replace")
    assert returncode == 0, output[-3000:]
    assert "stopping" in output
    assert wait_port_free(port), "the port is still held after the command exited"
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{base}/health", timeout=5)
