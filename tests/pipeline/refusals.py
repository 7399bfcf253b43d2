"""Several `raypack generate` refusals in one fresh Python process: each `main(argv)`'s exit
status and what it printed to stderr, and whether Ray was started by then (the process has
no Ray of its own, so any start shows). One process for all: each command checks its input
after importing the job's modules and torch (~3 s of CPU each on the 2-core box)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tests.fresh_python import run_python

SCRIPT = """
import contextlib, io, json, sys
import ray
from pipeline.commands.generate import main
out = []
for argv in json.loads(sys.stdin.read()):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    out.append([code, err.getvalue(), ray.is_initialized()])
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Refusal:
    returncode: int
    stderr: str  # the command's own stderr (sys.stderr while it ran)
    ray_started: bool


def refusals(argvs: list[list[str]]) -> tuple[list[Refusal], str]:
    """Each argv's run, and the process's own stderr (log lines, Ray's messages)."""
    done = run_python(SCRIPT, input=json.dumps(argvs))
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    return [Refusal(*run) for run in runs], done.stderr
