"""A Hugging Face hub cache laid out as huggingface_hub writes it (blobs, snapshots/<sha> of
symlinks, refs/main), built from a local model folder: what `hf download` leaves behind,
made without network."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from huggingface_hub.utils import filter_repo_objects


def cache_repo(
    cache: Path,
    repo_id: str,
    model_dir: Path,
    sha: str,
    allow_patterns: list[str] | None = None,
    main: bool = True,
) -> Path:
    """Put `model_dir`'s files (those `allow_patterns` keep, as huggingface_hub filters a
    download) into `cache` as the snapshot `sha` of `repo_id`, refs/main pointing at it when
    `main`; the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / sha
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    names = sorted(p.name for p in model_dir.iterdir())
    for name in filter_repo_objects(names, allow_patterns=allow_patterns):
        file = model_dir / name
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(file, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    if main:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(sha)
    return snapshot
