"""The `raypack` console command (`raypack generate | snippets | serve`); `jobs/*.py` are thin
scripts over the same code, for `ray job submit` and running from a checkout."""
