"""The `raypack` console command (`raypack generate | snippets | serve`), its flags and what it
prints; `jobs/*.py` are thin scripts over the same code, for `ray job submit` and a checkout."""
