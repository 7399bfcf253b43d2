"""A small synthetic prompt table for the pipeline tests.

Eight documents of about 100 tokens with 3 to 6 questions each (rows sharing a document share
a prompt prefix well over one 64-token key block, and all rows share the template's opening,
so the engine gets nested groups), six short prompts with no prefix key, and
malformed rows: a null document, a document over the tiny model's 512-token
context, an unknown and an invalid sampling override.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TEMPLATE = "Read the note, then answer.\n\n{document}\n\nQuestion: {query}\nAnswer:"
SAMPLE = Path(__file__).parents[2] / "jobs" / "data" / "snippets_sample.jsonl"
QUESTIONS = ["what is it", "who uses it", "why", "how fast", "is it safe", "an example"]
QUERIES_PER_DOC = [3, 4, 5, 6, 3, 4, 3, 5]
MALFORMED = {"null-doc", "long-doc", "unknown-override", "bad-override"}


def rows() -> list[dict]:
    """The table's rows (columns: id, doc_id, document, query, max_tokens, sampling)."""
    docs: dict[str, str] = {}
    for line in SAMPLE.read_text().splitlines():
        row = json.loads(line)
        docs.setdefault(row["doc_id"], row["document"][:450])
    names = list(docs)[: len(QUERIES_PER_DOC)]
    out = []
    for d, (name, n) in enumerate(zip(names, QUERIES_PER_DOC, strict=True)):
        for q in range(n):
            out.append(
                _row(f"{name}-{q}", name, docs[name], QUESTIONS[q], max_tokens=3 + (d + q) % 4)
            )
    for k in range(6):
        out.append(_row(f"short-{k}", f"short-{k}", f"Note {k}: tea is warm.", "why"))
    out.append(_row("null-doc", "x", None, "why"))
    out.append(_row("long-doc", "x", " ".join(["token"] * 700), "why"))
    out.append(_row("unknown-override", "y", "Some text.", "why", sampling='{"nucleus": 0.5}'))
    out.append(_row("bad-override", "y", "Some text.", "why", max_tokens=-1))
    return out


def _row(id_, doc_id, document, query, max_tokens=None, sampling=None) -> dict:
    return dict(
        id=id_,
        doc_id=doc_id,
        document=document,
        query=query,
        max_tokens=max_tokens,
        sampling=sampling,
    )


def write_prompt_table(path: Path) -> Path:
    """Write the table as Parquet; returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows()), path)
    return path
