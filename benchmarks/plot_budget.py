"""The step budget benchmark's figure (benchmarks/bench_budget.py), drawn from its JSON report
alone, so a saved report can be drawn again (`python benchmarks/plot_budget.py report.json
out.png [round]`): the controller's budget and step times over one replay, goodput per
configuration and round, and p50/p95 TTFT and TPOT of one round."""

from __future__ import annotations

import json
import sys
from typing import Any


def plot(path: str, report: dict[str, Any], round_index: int = 0) -> None:
    """Write the 2 x 2 figure for `report` (round `round_index` in the per-round panels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((budget_ax, good_ax), (ttft_ax, tpot_ax)) = plt.subplots(2, 2, figsize=(12, 8))
    slo = report["slo"]
    labels = list(report["by_round"])
    for label, steps in report.get("controller_budget", {}).items():
        times = [t for t, _, _ in steps]
        budget_ax.step(times, [b for _, _, b in steps], where="post", label=f"{label}: budget")
        twin = budget_ax.twinx()
        twin.plot(times, [1e3 * s for _, s, _ in steps], ".", ms=2, color="grey", alpha=0.6)
        twin.axhline(1e3 * slo["tpot_s"], color="k", ls="--", lw=0.8)
        twin.set_ylabel("step time (ms, grey dots; dashed: target)")
    for label in labels:
        if label.startswith("fixed-"):
            budget_ax.axhline(int(label.split("-")[1]), lw=0.6, ls=":", color="grey")
    budget_ax.set_xlabel("seconds into the first replay")
    budget_ax.set_ylabel("step token budget (dotted: the fixed ones)")
    budget_ax.legend(fontsize=7, loc="upper right")
    rounds = max(len(v) for v in report["by_round"].values())
    width = 0.8 / rounds
    for r in range(rounds):
        values = [report["by_round"][k][r]["goodput_req_s"] for k in labels]
        load = max(report["by_round"][k][r]["loadavg"][0] for k in labels)
        xs = [i + (r - (rounds - 1) / 2) * width for i in range(len(labels))]
        good_ax.bar(xs, values, width, label=f"round {r} (load avg up to {load:.1f})")
    good_ax.axhline(report["rate"], color="k", ls="--", lw=0.8, label="offered rate")
    good_ax.set_xticks(range(len(labels)), labels, fontsize=7)
    good_ax.set_ylabel("goodput (requests/s meeting both SLOs)")
    good_ax.legend(fontsize=7)
    for ax, key, scale, unit, bound in (
        (ttft_ax, "ttft", 1.0, "s", slo["ttft_s"]),
        (tpot_ax, "tpot", 1e3, "ms", 1e3 * slo["tpot_s"]),
    ):
        rows = [report["by_round"][k][round_index] for k in labels]
        for offset, q in ((-0.2, "p50"), (0.2, "p95")):
            values = [scale * row[f"{key}_{q}_s"] for row in rows]
            ax.bar([i + offset for i in range(len(labels))], values, 0.4, label=q)
        ax.axhline(bound, color="k", ls="--", lw=0.8, label="SLO")
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel(f"{key.upper()} ({unit}), round {round_index}")
        ax.legend(fontsize=7)
    fig.suptitle(
        f"{report['model']}, {report['trace']} at {report['rate']}/s for {report['duration_s']:g} s "
        f"({report['requests']} requests), SLOs TTFT {slo['ttft_s']} s and TPOT "
        f"{1e3 * slo['tpot_s']:.0f} ms",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        plot(sys.argv[2], json.load(handle), int(sys.argv[3]) if len(sys.argv) > 3 else 0)
