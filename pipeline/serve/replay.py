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


def _completion_tokens(line: str) -> int:
    import json

    usage = json.loads(line[len("data: ") :]).get("usage") or {}
    return int(usage.get("completion_tokens", 0))
