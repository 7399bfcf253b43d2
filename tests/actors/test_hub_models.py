"""Models by hub id: `org/name` (and `org/name@revision`) resolve under HF_HUB_OFFLINE=1 (set
for every test by tests/conftest.py: no test reaches the hub) from a Hugging Face cache laid
out as huggingface_hub writes it (tests/hub_cache.py), built here in tmp_path; a missing id
fails naming the id, the cache, the offline mode and how to fill it; a local folder spelled
like an id wins; the CLI refuses a missing id with exit 2. The engine runs from a snapshot
holding only the files the download keeps (`loader.HUB_FILES`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from actors import EngineConfig, LLMEngine, SamplingParams
from actors.loader import (
    HUB_FILES,
    ModelSource,
    hub_cache_dir,
    hub_offline,
    resolve,
    resolve_model,
)
from pipeline.io.lineage import model_identity
from tests.actors.reference import hf_greedy
from tests.hub_cache import cache_repo
from tests.tiny_models import save_tiny_model, tiny_model

ROOT = Path(__file__).parents[2]
SHA = "0123456789abcdef0123456789abcdef01234567"
OLD_SHA = "fedcba9876543210fedcba9876543210fedcba98"
PROMPTS = ["Hello there, how are you doing today?", "The capital of France is"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_dir: Path) -> Path:
    """HF_HOME in tmp_path with `org/tiny` at main (SHA) and an older revision (OLD_SHA)."""
    home = tmp_path / "hf-home"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.chdir(tmp_path)  # relative paths spelled like ids are looked for here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = home / "hub"
    # main: only what a download keeps (the weights also as .bin, a README: left out)
    cache_repo(cache, "org/tiny", tiny_dir, SHA, allow_patterns=list(HUB_FILES))
    cache_repo(cache, "org/tiny", tiny_dir, OLD_SHA, main=False)
    return cache


def test_hub_id_resolves_to_its_snapshot_in_the_cache(hub_cache, monkeypatch) -> None:  # noqa: ANN001
    assert hub_cache_dir() == hub_cache
    snapshot = hub_cache / "models--org--tiny" / "snapshots"
    assert resolve("org/tiny") == ModelSource(snapshot / SHA)
    assert resolve(f"org/tiny@{OLD_SHA}") == ModelSource(snapshot / OLD_SHA)
    assert resolve("org/tiny@main") == ModelSource(snapshot / SHA)
    # HF_HUB_CACHE names the cache itself and wins over HF_HOME
    monkeypatch.setenv("HF_HOME", "/nonexistent")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    assert resolve("org/tiny") == ModelSource(snapshot / SHA)
    # the lineage names the model by its snapshot (the revision is in the path)
    identity = model_identity(resolve_model("org/tiny"))
    assert identity["name"] == "org/tiny"
    assert identity["path"] == str((snapshot / SHA).resolve())
    assert identity["path"].endswith(f"snapshots/{SHA}")
    assert model_identity(resolve_model(f"org/tiny@{OLD_SHA}"))["path"].endswith(
        f"snapshots/{OLD_SHA}"
    )


def test_missing_hub_id_names_id_cache_and_remedy(hub_cache) -> None:  # noqa: ANN001
    with pytest.raises(FileNotFoundError) as info:
        resolve("org/missing")
    message = str(info.value)
    assert "'org/missing'" in message and str(hub_cache) in message
    assert "`hf download org/missing`" in message and "local model folder" in message
    assert "`huggingface-cli download org/missing`" in message  # huggingface_hub < 1.0
    assert "HF_HUB_OFFLINE is set, so nothing is downloaded" in message
    with pytest.raises(FileNotFoundError, match="at revision 'nope'.*hf download org/tiny --re"):
        resolve("org/tiny@nope")
    with pytest.raises(FileNotFoundError, match="neither 'smollm2'"):
        resolve("/no/such/model")  # not spelled like an id: the old message


def test_local_folder_named_like_an_id_wins(hub_cache, tmp_path, tiny_dir) -> None:  # noqa: ANN001
    local = tmp_path / "org" / "tiny"
    shutil.copytree(tiny_dir, local)
    assert resolve("org/tiny") == ModelSource(Path("org/tiny"))


def test_offline_mode_is_read_at_each_call(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    for value, offline in [("1", True), ("true", True), ("ON", True), ("0", False), ("", False)]:
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert hub_offline() is offline, value
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert not hub_offline()
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")  # huggingface_hub reads it too
    assert hub_offline()


def test_the_download_keeps_what_the_engine_reads(tiny_dir) -> None:  # noqa: ANN001
    from huggingface_hub.utils import filter_repo_objects

    names = sorted(p.name for p in tiny_dir.iterdir())
    assert "model.safetensors" in names and "config.json" in names
    kept = list(filter_repo_objects([*names, "pytorch_model.bin", "README.md", "model.gguf"],
                                    allow_patterns=list(HUB_FILES)))  # fmt: skip
    assert kept == names  # every file save_pretrained wrote, nothing else


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engine_by_hub_id_generates_like_the_snapshot_folder(hub_cache) -> None:  # noqa: ANN001
    params = SamplingParams(max_tokens=8)
    by_id = LLMEngine(EngineConfig(dtype="float32", model="org/tiny", num_kv_blocks=64))
    snapshot = hub_cache / "models--org--tiny" / "snapshots" / SHA
    by_path = LLMEngine(EngineConfig(dtype="float32", model=str(snapshot), num_kv_blocks=64))
    reference = tiny_model("llama")
    for prompt, a, b in zip(
        PROMPTS, by_id.generate(PROMPTS, params), by_path.generate(PROMPTS, params), strict=True
    ):
        assert a.token_ids == b.token_ids
        ids = by_id.tokenizer.encode(prompt, add_special_tokens=False)
        assert list(a.token_ids) == hf_greedy(reference, ids, 8)


@pytest.mark.timeout(120)
def test_cli_exits_2_for_a_hub_id_not_in_the_cache(tmp_path) -> None:  # noqa: ANN001
    data = tmp_path / "in.csv"
    data.write_text("id,prompt\nc1,hello\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "HF_HOME")}
    env["HF_HUB_CACHE"] = str(tmp_path / "empty-cache")
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run(
        [sys.executable, "jobs/generate.py", "--input", str(data), "--output",
         str(tmp_path / "out"), "--prompt-column", "prompt", "--model", "org/missing"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--model" in done.stderr and "'org/missing'" in done.stderr, done.stderr[-2000:]
    assert "hf download org/missing" in done.stderr and "HF_HUB_OFFLINE" in done.stderr
    assert "Started a local Ray" not in done.stderr  # refused before Ray
    assert not (tmp_path / "out").exists()  # before any work
