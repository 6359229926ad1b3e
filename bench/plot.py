"""Plot bench/compare.py results: step time and peak memory per system, one panel pair per world size.

python bench/compare.py --world 2 --json out/bench_w2.json
python bench/compare.py --world 4 --json out/bench_w4.json
python bench/plot.py out/bench_w2.json out/bench_w4.json --out docs/performance.png
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

CATEGORIES = ("params", "optimizer", "grads", "gathered", "comm", "buffers", "activations")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", type=pathlib.Path)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/performance.png"))
    args = p.parse_args()
    reports = [json.loads(path.read_text()) for path in args.reports]
    fig, axes = plt.subplots(len(reports), 2, figsize=(12, 3.6 * len(reports)), squeeze=False)
    for (time_ax, mem_ax), report in zip(axes, reports, strict=True):
        systems = list(report["systems"])
        entries = [report["systems"][s] for s in systems]
        medians = [e["step_s_median"] for e in entries]
        lows = [m - min(e["step_s_rep_medians"]) for m, e in zip(medians, entries, strict=True)]
        highs = [max(e["step_s_rep_medians"]) - m for m, e in zip(medians, entries, strict=True)]
        colors = ["tab:green" if s.startswith("fsdp_fn") else "tab:gray" for s in systems]
        time_ax.bar(systems, medians, yerr=[lows, highs], color=colors, capsize=4)
        time_ax.tick_params(axis="x", labelsize=7, rotation=20)
        mem_ax.tick_params(axis="x", labelsize=7, rotation=20)
        time_ax.set_ylabel("median step (s), max over ranks")
        time_ax.set_title(f"W={report['world']}: step time (min-max over {report['config']['reps']} reps)", fontsize=10)
        bottom = [0.0] * len(systems)
        for cat in CATEGORIES:
            values = [(e["peak_bytes"] or {}).get(cat, 0) / 2**20 for e in entries]
            if any(values):
                mem_ax.bar(systems, values, bottom=bottom, label=cat)
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        floor = report.get("floor", {}).get("total")
        if floor:
            mem_ax.axhline(floor / 2**20, color="black", linestyle="--", linewidth=1, label="floor")
        mem_ax.set_ylabel("peak live tensor MiB per rank")
        mem_ax.set_title(f"W={report['world']}: memory at the step's peak, by category", fontsize=10)
        mem_ax.legend(fontsize=7, ncol=2)
    params = reports[0]["params"] / 1e6
    fig.suptitle(
        f"[{reports[0].get('platform', 'CPU, gloo')}] GPT {params:.1f}M parameters, "
        f"{reports[0]['config']['batch']}x{reports[0]['config']['seq']} tokens per rank"
    )
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
