"""Replay an arrival trace against a live server and measure TTFT and latency (benchmarks).

The Azure LLM inference traces carry arrival times and token lengths, no text. A replay is a
list of load phases: each takes the next rows of the trace and scales their arrival times so the
phase offers the target rate, keeping the trace's burstiness. Prompts are real text (a token
stream made from a text corpus) cut to each row's length, so no two prompts share a prefix by
accident. Requests go to /v1/completions as token ids, streamed, with `ignore_eos` so each
generates exactly its trace length.
"""

from __future__ import annotations

import asyncio
import csv
import logging
import random
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Phase:
    """One load level: `rate` requests per second for `duration_s` seconds."""

    name: str
    rate: float
    duration_s: float


@dataclass(frozen=True)
class TraceRequest:
    """One request to send: when (seconds after the start), how long in and out."""

    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    phase: str


@dataclass(frozen=True)
class Result:
    """What one request measured at the client (seconds; None when it did not get there)."""

    arrival_s: float
    phase: str
    status: int
    ttft_s: float | None
    latency_s: float | None
    output_tokens: int
    finished_at_s: float | None


@dataclass(frozen=True)
class HealthSample:
    """The server's queue state at one moment of the replay."""

    t_s: float
    waiting: int
    running: int
    threshold: int


def read_trace(path: Path) -> list[tuple[float, int, int]]:
    """(seconds since the first row, context tokens, generated tokens) per row of an Azure trace."""
    rows = []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
            rows.append((stamp, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    start = rows[0][0]
    return [((t - start).total_seconds(), c, g) for t, c, g in rows]


def build_requests(
    trace: list[tuple[float, int, int]],
    phases: list[Phase],
    corpus: list[int],
    *,
    length_scale: float,
    output_scale: float,
    max_prompt_tokens: int,
    max_output_tokens: int,
    seed: int = 0,
) -> list[TraceRequest]:
    """The requests of all phases, back to back, from consecutive rows of the trace."""
    rng = random.Random(seed)
    requests: list[TraceRequest] = []
    cursor, start = 0, 0.0
    for phase in phases:
        count = max(1, round(phase.rate * phase.duration_s))
        rows = trace[cursor : cursor + count + 1]
        if len(rows) < count + 1:
            raise ValueError(f"the trace has too few rows for phase {phase.name!r}")
        span = rows[-1][0] - rows[0][0]
        scale = phase.duration_s / span if span > 0 else 0.0
        for t, context, generated in rows[:-1]:
            length = max(1, min(max_prompt_tokens, round(context * length_scale)))
            offset = rng.randrange(0, len(corpus) - length)
            requests.append(
                TraceRequest(
                    arrival_s=start + (t - rows[0][0]) * scale,
                    prompt_token_ids=tuple(corpus[offset : offset + length]),
                    max_tokens=max(1, min(max_output_tokens, round(generated * output_scale))),
                    phase=phase.name,
                )
            )
        cursor += count
        start += phase.duration_s
    return requests


async def replay(
    base_url: str,
    model: str,
    requests: list[TraceRequest],
    *,
    drain_s: float,
    health_every_s: float = 0.25,
) -> tuple[list[Result], list[HealthSample]]:
    """Send every request at its arrival time; wait at most `drain_s` after the last one."""
    import aiohttp

    t0 = time.monotonic()
    samples: list[HealthSample] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def poll() -> None:
            while True:
                try:
                    async with session.get(f"{base_url}/health") as response:
                        h = await response.json()
                    samples.append(
                        HealthSample(
                            time.monotonic() - t0, h["waiting"], h["running"], h["threshold"]
                        )
                    )
                except aiohttp.ClientError:
                    logger.debug("health poll failed", exc_info=True)
                await asyncio.sleep(health_every_s)

        async def one(request: TraceRequest) -> Result:
            await asyncio.sleep(max(0.0, request.arrival_s - (time.monotonic() - t0)))
            sent = time.monotonic()
            body = {
                "model": model,
                "prompt": list(request.prompt_token_ids),
                "max_tokens": request.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            ttft = None
            tokens = 0
            async with session.post(f"{base_url}/v1/completions", json=body) as response:
                if response.status != 200:
                    await response.read()
                    return Result(
                        request.arrival_s, request.phase, response.status, None, None, 0, None
                    )
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if ttft is None:
                        ttft = time.monotonic() - sent
                    if '"usage":{' in line:
                        tokens = _completion_tokens(line)
            done = time.monotonic()
            return Result(
                request.arrival_s, request.phase, 200, ttft, done - sent, tokens, done - t0
            )

        poller = asyncio.create_task(poll())
        tasks = [asyncio.create_task(one(r)) for r in requests]
        last_arrival = max(r.arrival_s for r in requests)
        deadline = last_arrival + drain_s - (time.monotonic() - t0)
        done, pending = await asyncio.wait(tasks, timeout=max(1.0, deadline))
        for task in pending:  # still unanswered at the bound: cancelled, counted as such
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
    results = []
    for request, task in zip(requests, tasks, strict=True):
        if task.cancelled() or task.exception() is not None:
            results.append(Result(request.arrival_s, request.phase, 0, None, None, 0, None))
        else:
            results.append(task.result())
    return results, samples


def summarise(
    results: list[Result], phases: list[Phase], rounds: int
) -> dict[str, dict[str, float]]:
    """TTFT and latency percentiles and throughput per phase and overall (`results` pools
    `rounds` replays of the same timeline)."""
    out: dict[str, dict[str, float]] = {}
    start = 0.0
    bounds = {}
    for phase in phases:
        bounds[phase.name] = start
        start += phase.duration_s
    for name in [p.name for p in phases] + ["overall"]:
        rows = [r for r in results if name == "overall" or r.phase == name]
        ok = [r for r in rows if r.status == 200 and r.ttft_s is not None]
        # a request unanswered within the drain bound counts as infinitely late
        ttft = np.array([np.inf if r.ttft_s is None else r.ttft_s for r in rows])
        e2e = np.array([np.inf if r.latency_s is None else r.latency_s for r in rows])
        begin = 0.0 if name == "overall" else bounds[name]
        end = max((r.finished_at_s or 0.0 for r in ok), default=begin + 1.0)
        tokens = sum(r.output_tokens for r in ok)
        out[name] = {
            "requests": len(rows),
            "completed": len(ok),
            "ttft_p50_s": _percentile(ttft, 50),
            "ttft_p95_s": _percentile(ttft, 95),
            "ttft_p99_s": _percentile(ttft, 99),
            "ttft_mean_s": float(np.mean(ttft[np.isfinite(ttft)])) if ok else float("nan"),
            "latency_p50_s": _percentile(e2e, 50),
            "latency_p95_s": _percentile(e2e, 95),
            "throughput_req_s": len(ok) / rounds / max(end - begin, 1e-9),
            "throughput_tok_s": tokens / rounds / max(end - begin, 1e-9),
        }
    return out


def check_bar(
    summary: dict[str, dict[str, dict[str, float]]], phases: list[Phase]
) -> dict[str, object]:
    """The issue's bar: aimd's overall p95 below every static policy's, and per phase within 10%
    of the best static policy."""

    def p95(label: str, level: str) -> float:
        return summary[label][level]["ttft_p95_s"]

    static = [label for label in summary if label != "aimd"]
    if "aimd" not in summary or not static:
        return {"checked": False}
    overall = {label: p95(label, "overall") for label in summary}
    per_phase = {}
    for phase in phases:
        best = min(p95(label, phase.name) for label in static)
        per_phase[phase.name] = {
            "aimd_p95_s": p95("aimd", phase.name),
            "best_static_p95_s": best,
            "within_10pct": p95("aimd", phase.name) <= 1.1 * best,
        }
    lower_overall = all(overall["aimd"] < overall[label] for label in static)
    return {
        "checked": True,
        "overall_p95_s": overall,
        "aimd_lowest_overall_p95": lower_overall,
        "per_phase": per_phase,
        "met": lower_overall and all(v["within_10pct"] for v in per_phase.values()),
    }


def _completion_tokens(line: str) -> int:
    import json

    usage = json.loads(line[len("data: ") :]).get("usage") or {}
    return int(usage.get("completion_tokens", 0))


def _percentile(values: np.ndarray, q: float) -> float:
    """numpy's percentile, where unanswered requests (inf) make any rank they reach inf."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return float("inf")
    big = float(finite.max()) + 1.0
    result = float(np.percentile(np.where(np.isfinite(values), values, big * 1e9), q))
    return result if result <= big - 1.0 else float("inf")
