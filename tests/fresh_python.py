"""A script run in a fresh Python of this interpreter, the repository on its path: what a Ray
worker or a command sees (nothing the test's process imported is there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def run_python(
    script: str, timeout: float = 120, *, input: str | None = None, text: bool = True
) -> subprocess.CompletedProcess:
    """Run `script` (`python -c`) from the repository's root with `input` on its stdin; its
    output as text (or bytes, `text=False`: a `\r` kept as it is). Without the test's
    `RAY_ADDRESS`: a command it runs starts (or refuses) its own Ray, as a user's would. The
    script must exit 0 (the assertion shows its stderr's end)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=input,
        capture_output=True,
        text=text,
        timeout=timeout,
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done
