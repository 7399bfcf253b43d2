"""Generate for every row of a prompt table: the script `ray job submit` runs, the same code as
`raypack generate` (pipeline/commands/generate.py).

    python jobs/generate.py --input prompts.parquet --output out/gen --prompt-column prompt
"""

from __future__ import annotations

import sys
from pathlib import Path

# From a checkout without `pip install .` (e.g. `ray job submit --working-dir .`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.commands.generate import build_config, build_parser, main  # noqa: E402

__all__ = ["build_config", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
