"""docs/models.md's tables are the registry's and the test matrix's (tests/models_doc.py)."""

from __future__ import annotations

from tests.models_doc import current, generated


def test_the_models_page_is_the_registry_and_the_matrix() -> None:
    assert current() == generated(), "docs/models.md is stale: run python -m tests.models_doc"
