"""The search-engine snippet job: the script `ray job submit` runs, the same code as
`raypack snippets` (pipeline/commands/snippets.py).

    python jobs/snippets.py --input jobs/data/snippets_sample.jsonl --output out/snippets
    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python jobs/snippets.py --input jobs/data/snippets_sample.jsonl --output /tmp/snippets
"""

from __future__ import annotations

import sys
from pathlib import Path

# From a checkout without `pip install .` (e.g. `ray job submit --working-dir .`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.commands.snippets import build_config, build_parser, main  # noqa: E402

__all__ = ["build_config", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
