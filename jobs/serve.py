"""Serve the engine online (OpenAI-compatible API on Ray Serve): the same code as
`raypack serve` (pipeline/commands/serve.py), as a script.

    python jobs/serve.py --host 127.0.0.1 --port 8000 --model smollm2 --policy aimd
"""

from __future__ import annotations

import sys
from pathlib import Path

# From a checkout without `pip install .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.commands.serve import build_parser, main  # noqa: E402

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
