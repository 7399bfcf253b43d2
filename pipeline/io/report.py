"""The end-of-job report: one summary (logged, and `_summary.json` in the output folder) and a
PNG (`_report.png`): prompt lengths, share degrees, padding avoided.

Both come from the small numeric columns of the files this run wrote, read back after the
write (never from rows collected on the driver), plus the planner's counts, which the plan
tasks send to a `StatsCollector` actor. Report files start with `_` so Parquet readers of the
folder (pyarrow, Ray Data, Spark) skip them.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pyarrow as pa

from pipeline.io import storage
from pipeline.io.id_table import IdTable, content_key
from pipeline.job.phases import EngineMarks
from pipeline.stages import stage
from pipeline.stages.plan import PlanStats

logger = logging.getLogger(__name__)

SUMMARY_FILE = "_summary.json"
REPORT_FILE = "_report.png"


class StatsCollector:
    """Sums the plan stats of all partitions (a Ray actor: `ray.remote(StatsCollector)`), and
    keeps one row per id across partitions (`claim_ids`).

    Keyed by partition, so a plan task that Ray retries replaces its earlier record and keeps
    the ids it claimed before.
    """

    def __init__(self) -> None:
        self._plans: dict[str, PlanStats] = {}
        # id -> the content hash of the first row read with it, and the partition that
        # claimed its dedupe key first: 40 bytes per id (pipeline/io/id_table.py), ~400 MB per
        # 10M rows in this actor. For ids read with different content, every version (hash,
        # preview or None).
        self._ids = IdTable()
        self._versions: dict[str, list[tuple[str, str | None]]] = {}
        self._planned: float | None = None  # when the last partition's plan arrived
        self._engines: dict[str, EngineMarks] = {}  # pipeline/job/phases.py, per engine actor

    def register_rows(self, ids: Sequence[str], hashes: Sequence[str]) -> list[bool]:
        """Record each row's id and content hash (the id stage, before the shuffle); for each,
        whether its id now has rows with different content (pipeline/stages/dedupe.py). A retried
        task registers the same pairs again, which changes nothing."""
        firsts = self._ids.first_contents(ids, hashes)
        for i, h, first in zip(ids, hashes, firsts, strict=True):
            if first != content_key(h):
                versions = self._versions.setdefault(i, [(first, None)])
                if all(v != h for v, _ in versions):
                    versions.append((h, None))
        return [i in self._versions for i in ids]

    def describe_rows(self, rows: Sequence[tuple[str, str, str]]) -> None:
        """Previews (id, hash, text) of rows whose id has several versions, for the errors."""
        for i, h, text in rows:
            versions = self._versions.get(i, [])
            for n, (v, _) in enumerate(versions):
                if v == h:
                    versions[n] = (v, text)

    def versions(self, ids: Sequence[str]) -> dict[str, list[tuple[str, str | None]]]:
        """The versions of those of `ids` that were read with different content."""
        return {i: self._versions[i] for i in set(ids) if i in self._versions}

    def claim_ids(self, partition: str, ids: Sequence[str]) -> list[bool]:
        """For each id, whether `partition` generates it: yes unless another partition
        claimed it first. The plan drops the rest, so an id that appears in two partitions
        (two read blocks, or two rows with one id but different prompts) is written once."""
        return self._ids.claim(partition, ids)

    def record_plan(self, key: str, stats: PlanStats) -> None:
        """Store one partition's plan stats (and when: the job's `planned` mark)."""
        self._plans[key] = stats
        self._planned = time.time()

    def record_engine(self, actor: str, marks: EngineMarks) -> None:
        """An engine actor's marks so far (pipeline/job/phases.py), merged with what it sent
        before (its shards' threads send in any order: the latest last step is kept)."""
        self._engines[actor] = self._engines.get(actor, marks).merged(marks)

    def timing(self) -> tuple[float | None, EngineMarks]:
        """When the last plan arrived, and the engine actors' marks merged."""
        merged = EngineMarks()
        for marks in self._engines.values():
            merged = merged.merged(marks)
        return self._planned, merged

    def plan_total(self) -> PlanStats:
        """All partitions' plan stats added up."""
        total = PlanStats()
        for stats in self._plans.values():
            total.merge(stats)
        return total


@dataclass(frozen=True)
class Summary:
    """What one run did. Token counts are over rows without an error."""

    output: str
    rows: int  # written by this run
    rows_skipped: int  # already in the output folder before this run
    error_rows: int
    prompt_tokens: int
    cached_prompt_tokens: int  # as the engines report: every member counts its shared prefix
    generated_tokens: int
    wall_time_s: float
    rows_per_s: float
    generated_tokens_per_s: float
    tokens_per_s: float  # prompt + generated
    prefix_saving_ratio: float  # prompt tokens the groups compute once, not per row / all
    optimal_saving_ratio: float  # the best any prefix sharing could do on these rows
    saving_vs_optimum: float | None  # prefix_saving_ratio / optimal_saving_ratio
    num_shards: int
    num_shared_groups: int  # prefix groups of two rows or more
    max_share_degree: int
    split_groups: int  # groups over a shard's limit, split with the prefix repeated
    duplicate_rows: int
    padding_avoided_tokens: int  # a padded batch per shard would have computed these too
    # the start-up's and the tail's parts, in seconds (pipeline/job/phases.py)
    phases_s: dict[str, float] = field(default_factory=dict)

    def log_line(self) -> str:
        """The one-line summary."""
        vs = f"{self.saving_vs_optimum:.1%} of optimum" if self.saving_vs_optimum else "n/a"
        return (
            f"{self.rows} rows ({self.error_rows} errors, {self.rows_skipped} already done) in "
            f"{self.wall_time_s:.1f}s: {self.prompt_tokens} prompt + {self.generated_tokens} "
            f"generated tokens, {self.generated_tokens_per_s:.1f} generated tok/s, "
            f"{self.tokens_per_s:.1f} tok/s; prefix saving {self.prefix_saving_ratio:.1%} "
            f"(optimum {self.optimal_saving_ratio:.1%}, {vs}); {self.num_shards} shards, "
            f"{self.num_shared_groups} shared groups"
        )


_COLUMNS = [
    stage.NUM_PROMPT_TOKENS,
    stage.NUM_CACHED_TOKENS,
    stage.NUM_GENERATED_TOKENS,
    stage.ERROR,
    stage.SHARD,
    stage.PREFIX_GROUP,
]


def summarize(
    output: str,
    files: Sequence[str | Path],
    plan: PlanStats,
    wall_time_s: float,
    rows_skipped: int,
) -> tuple[Summary, dict[str, Counter[int]]]:
    """The summary of the rows in `files`, and the distributions the PNG draws (as counts:
    prompt length -> rows, share degree -> groups). Read a row group at a time: a shard's
    rows are all in one (pipeline/io/writer.py), so per-shard and per-group figures add up group
    by group and the driver's memory does not grow with the rows."""
    import pyarrow.compute as pc

    n = errors = prompt = cached = generated = padded = 0
    prompt_lens: Counter[int] = Counter()
    degrees: Counter[int] = Counter()
    shards: set[str] = set()
    for table in _row_groups(files):
        n += table.num_rows
        ok = table.filter(pc.is_null(table.column(stage.ERROR)))
        errors += table.num_rows - ok.num_rows
        shards.update(table.column(stage.SHARD).unique().to_pylist())
        lens = ok.column(stage.NUM_PROMPT_TOKENS)
        prompt += pc.sum(lens).as_py() or 0
        cached += pc.sum(ok.column(stage.NUM_CACHED_TOKENS)).as_py() or 0
        generated += pc.sum(ok.column(stage.NUM_GENERATED_TOKENS)).as_py() or 0
        counts = lens.value_counts()
        values, times = counts.field(0).to_pylist(), counts.field(1).to_pylist()
        prompt_lens.update(dict(zip(values, times, strict=True)))
        degrees.update(Counter(ok.column(stage.PREFIX_GROUP).value_counts().field(1).to_pylist()))
        by_shard = ok.group_by(stage.SHARD).aggregate(
            [(stage.NUM_PROMPT_TOKENS, "max"), (stage.NUM_PROMPT_TOKENS, "count")]
        )
        padded += (
            pc.sum(
                pc.multiply(
                    by_shard.column(f"{stage.NUM_PROMPT_TOKENS}_max").cast("int64"),
                    by_shard.column(f"{stage.NUM_PROMPT_TOKENS}_count"),
                )
            ).as_py()
            or 0
        )
    # The plan's count, not the engines' cached tokens: an engine counts a shared prefix as
    # cached for every member, though it computes it once per group.
    saved = plan.planned_saved_tokens
    wall = max(wall_time_s, 1e-9)
    achieved = saved / plan.prompt_tokens if plan.prompt_tokens else 0.0
    optimal = plan.optimal_saved_tokens / plan.prompt_tokens if plan.prompt_tokens else 0.0
    summary = Summary(
        output=str(output),
        rows=n,
        rows_skipped=rows_skipped,
        error_rows=errors,
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        generated_tokens=generated,
        wall_time_s=round(wall_time_s, 3),
        rows_per_s=round(n / wall, 3),
        generated_tokens_per_s=round(generated / wall, 3),
        tokens_per_s=round((prompt + generated) / wall, 3),
        prefix_saving_ratio=round(achieved, 5),
        optimal_saving_ratio=round(optimal, 5),
        saving_vs_optimum=round(achieved / optimal, 5) if optimal > 0 else None,
        num_shards=len(shards),
        num_shared_groups=sum(c for d, c in degrees.items() if d > 1),
        max_share_degree=max(degrees, default=0),
        split_groups=plan.split_groups,
        duplicate_rows=plan.duplicate_rows,
        padding_avoided_tokens=padded - prompt,
    )
    distributions = {
        "prompt_lens": prompt_lens,
        "share_degrees": degrees,
        "tokens": Counter({0: padded, 1: prompt, 2: prompt - saved}),
    }
    return summary, distributions


def _row_groups(files: Sequence[str | Path]) -> Iterator[pa.Table]:
    """The report's columns of `files`, a row group at a time: the writers flush whole shards
    into a row group (pipeline/io/writer.py), so shards and their groups are never cut."""
    import pyarrow.parquet as pq

    for f in files:
        with storage.open_input(f) as handle:
            parquet = pq.ParquetFile(handle)
            for i in range(parquet.num_row_groups):
                yield parquet.read_row_group(i, columns=_COLUMNS)


def write_report(
    output: str | Path,
    summary: Summary,
    distributions: dict[str, Counter[int]],
    phases: Callable[[], dict[str, float]] | None = None,
) -> Summary:
    """`_report.png`, then `_summary.json` in the output folder (local or a URI); the summary
    written, with `phases()` (pipeline/job/phases.py) as its `phases_s` when given: called after
    the picture, so the report's own time is in it."""
    storage.makedirs(output)
    plot(distributions, storage.join(output, REPORT_FILE))
    if phases is not None:
        summary = replace(summary, phases_s=phases())
    text = json.dumps(asdict(summary), indent=2) + "\n"
    storage.write_bytes(storage.join(output, SUMMARY_FILE), text.encode())
    return summary


def plot(distributions: dict[str, Counter[int]], path: str | Path) -> None:
    """Three panels: prompt-length histogram, share-degree distribution, padding avoided
    (`distributions` as `summarize` gives them: value -> count)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lens_ax, share_ax, pad_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    lens = distributions["prompt_lens"] or Counter({0: 0})
    lens_ax.hist(list(lens), weights=list(lens.values()), bins=40, color="#4477aa")
    lens_ax.set(title="Prompt lengths", xlabel="prompt tokens", ylabel="rows")

    degrees = distributions["share_degrees"]
    xs = sorted(degrees)
    share_ax.bar([str(x) for x in xs], [degrees[x] * x for x in xs], color="#228833")
    share_ax.set(title="Share degree", xlabel="rows sharing one prefix", ylabel="rows")

    padded, packed, computed = (distributions["tokens"][k] for k in range(3))
    bars = pad_ax.bar(
        ["padded batches", "packed", "packed, prefix once"],
        [padded, packed, computed],
        color=["#bbbbbb", "#4477aa", "#228833"],
    )
    pad_ax.bar_label(bars, fmt="%d")
    pad_ax.set(
        title=f"Prompt tokens computed (padding avoided: {padded - packed})", ylabel="tokens"
    )
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    storage.write_bytes(path, png.getvalue())
    plt.close(fig)
