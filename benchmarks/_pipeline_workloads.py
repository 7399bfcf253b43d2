"""Workloads and measurements of benchmarks/bench_pipeline.py.

The workloads: HH-RLHF pairs and synthetic snippets (documents shared by `share` queries),
shuffled with a fixed seed as a query log would be. The measurements read a run's output
folder back: prompt tokens the engines computed, how a document's rows were spread over
shards, and the CPU seconds the whole local Ray cluster spent (on a shared box the wall clock
swings with the other users' load; CPU seconds much less).
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import json
import os
import random
import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("RAYPACK_DATA_DIR", ROOT.parent / "shared" / "data"))
HH = DATA_DIR / "hh_rlhf_harmless_base_test.jsonl.gz"
DOC_MODULES = [
    "json", "statistics", "configparser", "re", "sys", "wave", "turtle", "site", "shelve",
    "uuid", "hashlib", "socket", "csv", "argparse", "heapq", "itertools", "copy", "unittest",
    "doctest", "timeit", "urllib.parse", "http.client", "plistlib", "subprocess", "io", "os",
    "struct", "sched", "inspect", "typing", "sqlite3", "ftplib", "smtplib", "tempfile",
    "asyncio", "logging", "pickle", "zipfile", "tarfile", "datetime", "decimal", "fractions",
    "functools", "collections", "pathlib", "string", "textwrap", "ast", "dis", "pdb",
]  # fmt: skip


def hh_rows(num_dialogues: int, max_tokens: int, tokenizer, seed: int) -> list[dict]:  # noqa: ANN001
    """Two rows per dialogue (chosen, rejected), dialogues whose transcripts fit max_tokens."""
    rows: list[dict] = []
    with gzip.open(HH, "rt", encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            record = json.loads(line)
            texts = [record["chosen"], record["rejected"]]
            if any(len(tokenizer(t)["input_ids"]) > max_tokens for t in texts):
                continue
            rows += [{"id": f"{i}-{k}", "text": t} for k, t in zip(("c", "r"), texts, strict=True)]
            if len(rows) >= 2 * num_dialogues:
                break
    random.Random(seed).shuffle(rows)
    return rows


def snippet_rows(
    num_docs: int,
    share: int,
    doc_tokens: int,
    query_tokens: int,
    tokenizer,  # noqa: ANN001
    seed: int,
) -> list[dict]:
    """`num_docs` documents of `doc_tokens` tokens, each with `share` queries of
    `query_tokens` tokens: consecutive pieces of Python docstrings, none shared. Row ids are
    `d<document>-q<query>` (see `document_of`)."""
    pool: list[int] = []
    need = num_docs * (doc_tokens + share * query_tokens)
    for name in DOC_MODULES:
        doc = inspect.cleandoc(importlib.import_module(name).__doc__ or "")
        pool += tokenizer(doc + "\n\n")["input_ids"]
        if len(pool) >= need:
            break
    if len(pool) < need:
        raise ValueError(f"the docstrings give {len(pool)} tokens, {need} needed; ask for less")
    rows = []
    at = 0
    for d in range(num_docs):
        document = tokenizer.decode(pool[at : at + doc_tokens])
        at += doc_tokens
        for q in range(share):
            query = tokenizer.decode(pool[at : at + query_tokens])
            at += query_tokens
            rows.append({"id": f"d{d}-q{q}", "document": document, "query": query})
    random.Random(seed).shuffle(rows)
    return rows


def document_of(row_id: str) -> str:
    """The document a snippet row belongs to (`d3-q7` -> `d3`)."""
    return row_id.split("-", 1)[0]


class ClusterCPU:
    """CPU seconds used by this process and all its descendants (the local Ray: raylet, GCS,
    workers) between `start` and `stop`.

    A background thread samples the process tree every `interval` seconds and keeps each
    process's last reading, so a worker that exits (an engine actor at the end of a run)
    still counts, up to its last sample: at most `interval` seconds lost per process. The
    children-times of a parent are not used: Ray does not reap every worker, and those that
    are reaped would be counted twice.
    """

    def __init__(self, interval: float = 0.5):
        self.interval = interval
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Take the baseline and start sampling."""
        self._first = self._sample()
        self._last = dict(self._first)
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> float:
        """Stop sampling; the CPU seconds used since `start`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._last.update(self._sample())
        return sum(t - self._first.get(pid, 0.0) for pid, t in self._last.items())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._last.update(self._sample())

    @staticmethod
    def _sample() -> dict[int, float]:
        import psutil

        me = psutil.Process(os.getpid())
        times: dict[int, float] = {}
        for proc in [me, *me.children(recursive=True)]:
            try:
                t = proc.cpu_times()
            except psutil.Error:  # exited between the listing and the read
                continue
            times[proc.pid] = t.user + t.system
        return times


def output_measures(
    output: str | Path, tokens_by_id: Mapping[str, Sequence[int]], documents: bool
) -> dict:
    """What the engines computed, read back from a run's Parquet files.

    `computed_prompt_tokens`: per row, the prompt tokens not served from a shared prefix or
    cached KV blocks (`num_prompt_tokens - num_cached_tokens`), plus, per shard, the tokens of
    its shared prefixes computed once (the size of the trie of the rows' shared prefixes:
    nested groups share their parent's tokens). Recomputation after a preemption is not
    counted, nor are block-cache hits on a prefix itself (so on "on" runs it is a slight
    upper bound). With `documents` (snippet ids) it also says how each document's rows
    spread over shards.
    """
    import pyarrow.parquet as pq

    from pipeline.io.resume import data_files

    columns = [
        "id",
        "shard",
        "num_prompt_tokens",
        "num_cached_tokens",
        "shared_prefix_len",
        "error",
    ]
    rows = [r for f in data_files(output) for r in pq.read_table(f, columns=columns).to_pylist()]
    ok = [r for r in rows if r["error"] is None]
    computed = sum(r["num_prompt_tokens"] - r["num_cached_tokens"] for r in ok)
    prefixes: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for r in ok:
        if r["shared_prefix_len"]:
            prefixes[r["shard"]].add(tuple(tokens_by_id[r["id"]][: r["shared_prefix_len"]]))
    computed += sum(trie_size(p) for p in prefixes.values())
    out: dict = {"computed_prompt_tokens": computed, "shards": len({r["shard"] for r in rows})}
    if documents:
        shards_of: dict[str, set[str]] = defaultdict(set)
        docs_in: dict[str, set[str]] = defaultdict(set)
        for r in rows:
            shards_of[document_of(r["id"])].add(r["shard"])
            docs_in[r["shard"]].add(document_of(r["id"]))
        out["shards_per_document"] = round(
            sum(len(s) for s in shards_of.values()) / max(len(shards_of), 1), 2
        )
        out["documents_per_shard"] = round(
            sum(len(d) for d in docs_in.values()) / max(len(docs_in), 1), 2
        )
    return out


def trie_size(prefixes: Sequence[Sequence[int]] | set[tuple[int, ...]]) -> int:
    """Nodes of the token trie over `prefixes`: the tokens computed when each distinct prefix
    position is computed once (sorted, each adds its length minus what it shares with the
    one before)."""
    ordered = sorted(tuple(p) for p in prefixes)
    total = 0
    for before, prefix in zip([()] + ordered, ordered, strict=False):
        common = 0
        for a, b in zip(before, prefix, strict=False):
            if a != b:
                break
            common += 1
        total += len(prefix) - common
    return total
