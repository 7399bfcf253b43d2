"""A script run in a fresh Python of this interpreter, the repository on its path: what a Ray
worker or a command sees (nothing the test's process imported is there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def run_python(script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `script` (`python -c`) from the repository's root; its output as text."""
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
