"""The step budget benchmark's figure (benchmarks/bench_budget.py): TTFT and TPOT
distributions per configuration with the SLOs, the controller's budget over a replay, and
goodput."""

from __future__ import annotations

from typing import Any

import numpy as np


def plot(path: str, runs: dict[str, Any], report: dict[str, Any]) -> None:
    """Write the 2 x 2 figure to `path` (`runs`: label -> list of `Replay`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ttft_ax, tpot_ax), (budget_ax, good_ax) = axes
    slo = report["slo"]
    for label, reps in runs.items():
        timings = [t for r in reps for t in r.timings]
        for ax, values in (
            (ttft_ax, [t.ttft_s for t in timings]),
            (tpot_ax, [1e3 * t.tpot_s for t in timings]),
        ):
            data = np.sort(np.array(values))
            shown = data[np.isfinite(data)]
            share = np.arange(1, shown.size + 1) / max(data.size, 1)
            ax.step(shown, share, where="post", label=label)
    ttft_ax.axvline(slo["ttft_s"], color="k", ls="--", lw=0.8, label="SLO")
    ttft_ax.set_xscale("log")
    ttft_ax.set_xlabel("TTFT (s)")
    tpot_ax.axvline(1e3 * slo["tpot_s"], color="k", ls="--", lw=0.8, label="SLO / target")
    tpot_ax.set_xlabel("TPOT (ms per output token)")
    for ax in (ttft_ax, tpot_ax):
        ax.set_ylabel("share of requests")
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3)
    for label, reps in runs.items():
        steps = reps[0].steps
        if not steps:
            continue
        times = [t for t, _, _ in steps]
        if label.startswith("tpot"):
            budget_ax.step(times, [b for _, _, b in steps], where="post", label=f"{label}: budget")
            twin = budget_ax.twinx()
            twin.plot(times, [1e3 * s for _, s, _ in steps], ".", ms=2, color="grey", alpha=0.5)
            twin.axhline(1e3 * slo["tpot_s"], color="k", ls="--", lw=0.8)
            twin.set_ylabel("step time (ms, grey dots)")
        else:
            budget_ax.axhline(steps[0][2], lw=0.6, ls=":", color="grey")
    budget_ax.set_xlabel("seconds into the first replay")
    budget_ax.set_ylabel("step token budget")
    budget_ax.legend(fontsize=7, loc="upper left")
    labels = list(report["results"])
    goodput = [report["results"][k]["goodput_req_s"] for k in labels]
    good_ax.bar(range(len(labels)), goodput, color=[f"C{i}" for i in range(len(labels))])
    good_ax.axhline(report["rate"], color="k", ls="--", lw=0.8, label="offered rate")
    good_ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=10)
    good_ax.set_ylabel("goodput (requests/s meeting both SLOs)")
    good_ax.legend(fontsize=7)
    fig.suptitle(
        f"{report['model']}, {report['trace']} at {report['rate']}/s, "
        f"SLOs TTFT {slo['ttft_s']} s and TPOT {1e3 * slo['tpot_s']:.0f} ms",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
