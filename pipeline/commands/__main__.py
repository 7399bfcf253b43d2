"""`python -m pipeline.commands ...`, the same as the `raypack` console script."""

import sys

from pipeline.commands.main import main

sys.exit(main())
