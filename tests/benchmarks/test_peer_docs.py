"""bench_peers.py's prefix-heavy set: every document at least as long as asked, each shared by
its questions as the prompt prefix (through the chat template), rows shuffled the same way
every run; the vLLM environment names what its CPU docs ask for."""

from __future__ import annotations

from benchmarks import bench_peers
from benchmarks.bench_job import prompt_ids
from benchmarks.peer_docs import prefix_messages


def test_documents_are_shared_prefixes_of_their_questions(tokenizer) -> None:
    rows = prefix_messages(tokenizer, num_docs=3, doc_tokens=300, per_doc=4, seed=0)
    assert len(rows) == 12 and len({rid for rid, _ in rows}) == 12
    assert rows == prefix_messages(tokenizer, num_docs=3, doc_tokens=300, per_doc=4, seed=0)
    docs = [rid.rsplit("-", 1)[0] for rid, _ in rows]
    assert docs != sorted(docs)  # shuffled, not grouped
    ids = {rid: prompt_ids(tokenizer, m) for rid, m in rows}
    for doc in set(docs):
        members = [ids[rid] for rid in ids if rid.startswith(f"{doc}-")]
        shared = 0
        while all(len(m) > shared and m[shared] == members[0][shared] for m in members):
            shared += 1
        assert shared >= 300  # the document, rendered once for all its questions
    other = [ids[rid] for rid in ids if not rid.startswith(f"{docs[0]}-")][0]
    assert other[:300] != ids[rows[0][0]][:300]


def test_vllm_env_binds_threads_and_caps_the_kv_cache() -> None:
    env = bench_peers.vllm_env(threads=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_engine_variants_are_named_by_what_differs_from_the_defaults() -> None:
    parser_args = ["--attention-backends", "auto,sdpa", "--linear-backends", "auto,torch"]
    args = bench_peers.parse_args(parser_args)
    variants = dict(bench_peers.engine_variants(args))
    assert list(variants) == ["engine", "engine-torch", "engine-sdpa", "engine-sdpa-torch"]
    assert variants["engine-sdpa-torch"]["attention_backend"] == "sdpa"
    assert variants["engine-sdpa-torch"]["linear_backend"] == "torch"
    assert variants["engine"]["attention_backend"] == variants["engine"]["linear_backend"] == "auto"
