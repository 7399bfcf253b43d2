"""The serving command line itself (`python jobs/serve.py`, the same code as `raypack serve`)
as a user runs it: a subprocess on a free port with the tiny model saved to a temporary
folder, two replicas without the prefix-routing front. It answers /health, a greedy completion
equals Hugging Face `generate`, /metrics covers both replicas (the replica that gets it asks its
siblings: tests/serve/replica_metrics.py, the check test_metrics_http.py runs behind the
front), and SIGTERM makes it exit 0 and release the port.

One command run (each starts its own Ray, Serve and replicas: 23-32 s of a test under load):
SIGTERM is the signal it is stopped by, the one whose handler `ray.init` replaces (under Ray's
the command exits 15), so the run shows that the command's own handler is installed
after `ray.init` and that an interrupt shuts down cleanly. SIGINT takes the same way once
`interrupt_on_signals` has made it a KeyboardInterrupt: checked in this process, from SIG_IGN
(what a background job of a non-interactive shell inherits for SIGINT). The one-replica app's
/metrics from its own engine is test_metrics_http.py's `main` app case, and its CPU share
test_fit.py's. Timeouts are hang guards only."""

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

from pipeline.commands.serve import interrupt_on_signals
from tests.serve.conftest import free_port
from tests.serve.hf_reference import HFReference
from tests.serve.replica_metrics import check_metrics_cover_both_replicas

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


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_both_signals_interrupt_the_command_even_when_ignored(stop_signal: signal.Signals) -> None:
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for sig in kept:  # as a process started by `cmd &` in a script inherits SIGINT
            signal.signal(sig, signal.SIG_IGN)
        interrupt_on_signals()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(stop_signal)
            time.sleep(5)  # the handler runs at once; this is a guard
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)


def test_serve_command_serves_and_stops_cleanly(tiny_model_dir: Path, tmp_path: Path) -> None:
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
        "--num-replicas", "2",
        "--no-prefix-routing",  # the front's /metrics is test_metrics_http.py's
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
        check_metrics_cover_both_replicas(base, "tiny", front=False)

        process.send_signal(signal.SIGTERM)
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
