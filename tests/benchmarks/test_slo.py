"""The step budget benchmark's measures: TTFT, TPOT, SLO attainment and goodput, and its
replay loop on a tiny engine (bundled trace head, no Ray)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from actors import EngineConfig, LLMEngine
from benchmarks.bench_budget import run_replay
from benchmarks.replay import Phase, build_requests, read_trace
from benchmarks.slo import Timing, percentile, summarise
from tests.tiny_models import tiny_model

TRACE = Path(__file__).resolve().parents[1] / "data" / "azure_llm_trace_2023_conv_head.csv"


def test_ttft_and_tpot_of_one_request() -> None:
    t = Timing(arrival_s=10.0, first_token_s=10.5, finished_s=12.5, output_tokens=5)
    assert t.ttft_s == 0.5 and t.tpot_s == 0.5  # 2 s over the 4 tokens after the first
    assert Timing(0.0, 1.0, 1.0, 1).tpot_s == 0.0  # one token: no TPOT to miss
    never = Timing(0.0, None, None, 0)
    assert math.isinf(never.ttft_s) and math.isinf(never.tpot_s)
    assert math.isinf(Timing(0.0, 1.0, None, 3).tpot_s)  # started, never finished


def test_percentile_counts_unfinished_as_infinitely_late() -> None:
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert math.isinf(percentile([1.0, 2.0, math.inf, math.inf], 50))  # rank 1.5
    assert percentile([1.0] * 19 + [math.inf], 50) == 1.0
    assert math.isinf(percentile([1.0] * 19 + [math.inf], 99))
    assert math.isinf(percentile([math.inf], 50)) and math.isnan(percentile([], 50))


def test_goodput_counts_requests_meeting_both_slos() -> None:
    timings = [
        Timing(0.0, 0.5, 1.5, 11),  # TTFT 0.5, TPOT 0.1: meets both
        Timing(0.0, 3.0, 4.0, 11),  # TTFT 3.0: misses TTFT
        Timing(0.0, 0.5, 5.5, 11),  # TPOT 0.5: misses TPOT
        Timing(0.0, None, None, 0),  # never served
    ]
    row = summarise(timings, ttft_slo_s=1.0, tpot_slo_s=0.2, window_s=2.0)
    assert row["requests"] == 4 and row["finished"] == 3
    assert row["ttft_met"] == 0.5 and row["tpot_met"] == 0.5 and row["slo_met"] == 0.25
    assert row["goodput_req_s"] == 0.5  # one request in a 2 s window
    assert row["ttft_p50_s"] == pytest.approx(1.75)


@pytest.mark.parametrize("tpot_target_s", [None, 1e-9])
def test_replay_loop_times_every_request(tokenizer, tpot_target_s) -> None:
    requests = build_requests(
        read_trace(TRACE),
        [Phase("replay", 20.0, 0.5)],
        list(range(1000, 3000)),
        length_scale=0.05,
        output_scale=0.05,
        max_prompt_tokens=48,
        max_output_tokens=6,
    )
    config = EngineConfig(
        dtype="float32",
        num_kv_blocks=128,
        max_num_batched_tokens=64,
        chunk_size=32,
        tpot_target_s=tpot_target_s,
    )
    engine = LLMEngine(config, model=tiny_model("llama"), tokenizer=tokenizer)
    replay = run_replay(engine, requests, drain_s=120.0)
    assert len(replay.timings) == len(requests) == 10
    for timing, request in zip(replay.timings, requests, strict=True):
        assert timing.output_tokens == request.max_tokens  # ignore_eos: the trace's length
        assert timing.first_token_s is not None and timing.finished_s is not None
        assert (
            timing.first_token_s >= timing.arrival_s and timing.finished_s >= timing.first_token_s
        )
    assert replay.steps and all(1 <= b <= 64 for _, _, b in replay.steps)
    if tpot_target_s is not None:  # every step over the target: the budget went to its floor
        assert min(b for _, _, b in replay.steps) < 64


def test_figure_is_drawn_from_the_json_report(tmp_path) -> None:
    from benchmarks.plot_budget import plot

    row = {
        "goodput_req_s": 1.0,
        "loadavg": [1.0, 1.0],
        "ttft_p50_s": 0.5,
        "ttft_p95_s": 2.0,
        "tpot_p50_s": 0.1,
        "tpot_p95_s": 0.3,
    }
    report = {
        "model": "tiny",
        "trace": "head.csv",
        "rate": 1.5,
        "duration_s": 30.0,
        "requests": 45,
        "slo": {"ttft_s": 2.0, "tpot_s": 0.25},
        "by_round": {"fixed-128": [row, row], "tpot-250ms": [row, row]},
        "controller_budget": {"tpot-250ms": [[0.0, 0.3, 512], [0.3, 0.2, 384], [0.5, 0.1, 400]]},
    }
    plot(str(tmp_path / "f.png"), report)
    assert (tmp_path / "f.png").stat().st_size > 10_000
