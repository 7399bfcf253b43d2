"""Building a replay from the Azure trace: phases, time scaling, length caps."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.replay import Phase, Result, build_requests, check_bar, read_trace, summarise

TRACE = Path(__file__).resolve().parents[1] / "data" / "azure_llm_trace_2023_conv_head.csv"


def test_phases_scale_the_trace_to_their_rates() -> None:
    trace = read_trace(TRACE)
    assert trace[0][0] == 0.0 and len(trace) == 200  # the bundled head of the trace
    assert all(b[0] >= a[0] for a, b in zip(trace, trace[1:], strict=False))
    phases = [Phase("low", 0.5, 20.0), Phase("high", 4.0, 10.0)]
    corpus = list(range(10_000))
    requests = build_requests(
        trace,
        phases,
        corpus,
        length_scale=0.125,
        output_scale=0.0625,
        max_prompt_tokens=64,
        max_output_tokens=8,
    )
    low = [r for r in requests if r.phase == "low"]
    high = [r for r in requests if r.phase == "high"]
    assert (len(low), len(high)) == (10, 40)
    assert 0.0 == low[0].arrival_s <= low[-1].arrival_s < 20.0 <= high[0].arrival_s
    assert high[-1].arrival_s < 30.0
    assert all(1 <= len(r.prompt_token_ids) <= 64 and 1 <= r.max_tokens <= 8 for r in requests)
    # prompts are contiguous cuts of the corpus (real text in the benchmark)
    first = requests[0].prompt_token_ids
    assert list(first) == list(range(first[0], first[0] + len(first)))
    with pytest.raises(ValueError, match="too few rows"):
        build_requests(
            trace[:5], phases, corpus, length_scale=1, output_scale=1,
            max_prompt_tokens=8, max_output_tokens=8,
        )  # fmt: skip


def test_summary_counts_unanswered_requests_as_infinitely_late_and_checks_the_bar() -> None:
    phases = [Phase("low", 1.0, 10.0), Phase("high", 2.0, 10.0)]

    def results(ttfts: list[float | None]) -> list[Result]:
        return [
            Result(float(i), "low" if i < 10 else "high", 200 if t is not None else 0, t,
                   None if t is None else t + 1, 4 if t is not None else 0,
                   None if t is None else i + t + 1)
            for i, t in enumerate(ttfts)
        ]  # fmt: skip

    fast = summarise(results([0.1] * 20), phases, 1)
    assert fast["overall"]["completed"] == 20 and fast["low"]["ttft_p95_s"] == pytest.approx(0.1)
    assert fast["overall"]["throughput_tok_s"] > 0
    lossy = summarise(results([0.1] * 18 + [None, None]), phases, 1)
    assert lossy["high"]["completed"] == 8 and lossy["high"]["ttft_p95_s"] == float("inf")
    slow = summarise(results([0.5] * 20), phases, 1)
    verdict = check_bar({"immediate": slow, "aimd": fast}, phases)
    assert verdict["met"] is True and verdict["aimd_lowest_overall_p95"] is True
    verdict = check_bar({"immediate": fast, "aimd": slow}, phases)
    assert verdict["met"] is False
