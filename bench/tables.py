"""Markdown tables from bench/compare.py reports, as docs/performance.md and docs/memory.md show them.

python bench/tables.py out/w2.json out/w4.json            # step time, memory, correctness
python bench/tables.py out/w2.json --memory               # peak by category
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

MIB = 2**20
CATEGORIES = ("params", "gathered", "grads", "optimizer", "comm", "activations")
# Each fsdp_fn row against the FSDP2 row that does the same work (bench/compare.py's PAIRS).
PEERS = {
    "fsdp_fn": "fsdp2",
    "fsdp_fn+split_root": "fsdp2",
    "fsdp_fn+levers": "fsdp2+tuned",
    "fsdp_fn+remat": "fsdp2+ac",
    "fsdp_fn+selective": "fsdp2+ac",
    "fsdp_fn+remat+levers": "fsdp2+ac",
    "fsdp_fn+remat+levers+chunked": "fsdp2+ac+chunked",
}


def _peer(name: str, systems: dict[str, Any]) -> str | None:
    peer = PEERS.get(name, "fsdp2" if name.startswith("fsdp_fn") else None)
    return peer if peer in systems else None


def speed_table(report: dict[str, Any]) -> str:
    systems = report["systems"]
    ddp = systems.get("ddp", {}).get("step_s_median")
    rows = [
        f"| system [{report['platform']}] | step s, median (min-max of rep medians) | CPU floor s | tokens/s "
        "| x its FSDP2 | x DDP | comm MB/step/rank | peak MiB/rank (torch's tracker) "
        "| max rel. diff to one process: loss / grad norm |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in systems.items():
        lo, hi = min(s["step_s_rep_medians"]), max(s["step_s_rep_medians"])
        peer = _peer(name, systems)
        vs_peer = f"{s['step_s_median'] / systems[peer]['step_s_median']:.2f}" if peer else ""
        vs_ddp = f"{s['step_s_median'] / ddp:.2f}" if ddp else ""
        peak = (s.get("peak_bytes") or {}).get("total", 0) / MIB
        tracker = (s.get("torch_tracker_peak_bytes") or 0) / MIB
        diff = s.get("max_rel_diff_to_single")
        if diff is None and "single" in systems and name != "single":
            ref = systems["single"]
            diff = {
                "loss": max(abs(a - b) / abs(b) for a, b in zip(s["losses"], ref["losses"], strict=True)),
                "grad_norm": max(abs(a - b) / abs(b) for a, b in zip(s["grad_norms"], ref["grad_norms"], strict=True)),
            }
        correct = (
            f"{diff['loss']:.0e} / {diff['grad_norm']:.0e}" if diff else "(reference)" if name == "single" else "-"
        )
        comm = s.get("comm_bytes_per_step") or 0
        floor = f"{s['cpu_floor_s_median']:.3f}" if "cpu_floor_s_median" in s else "-"  # older reports: absent
        rows.append(
            f"| {name} | {s['step_s_median']:.3f} ({lo:.3f}-{hi:.3f}) | {floor} | {s['tokens_per_s']:.0f} "
            f"| {vs_peer} | {vs_ddp} "
            f"| {comm / 1e6:.1f} | {peak:.1f} ({tracker:.1f}) | {correct} |"
        )
    return "\n".join(rows)


def memory_table(report: dict[str, Any]) -> str:
    systems = report["systems"]
    rows = [
        f"| system [{report['platform']}, W={report['world']}] | "
        + " | ".join(CATEGORIES)
        + " | **total** | torch's tracker | x its FSDP2 | peak during |",
        "|---|" + "---|" * (len(CATEGORIES) + 4),
    ]
    for name, s in systems.items():
        peak = s.get("peak_bytes") or {}
        peer = _peer(name, systems)
        ratio = f"{peak['total'] / systems[peer]['peak_bytes']['total']:.3f}" if peer and peak else ""
        rows.append(
            f"| {name} | "
            + " | ".join(f"{peak.get(c, 0) / MIB:.1f}" for c in CATEGORIES)
            + f" | **{peak.get('total', 0) / MIB:.1f}** | {(s.get('torch_tracker_peak_bytes') or 0) / MIB:.1f} | {ratio} "
            + f"| `{(s.get('peak_op') or '-').split(' (')[0]}` |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", type=pathlib.Path)
    p.add_argument("--memory", action="store_true", help="peak bytes by category instead")
    args = p.parse_args()
    for path in args.reports:
        report = json.loads(path.read_text())
        cfg = report["config"]
        print(
            f"\n{path}: W={report['world']}, {cfg['batch']}x{cfg['seq']} tokens per rank, "
            f"{cfg['reps']} reps x {cfg['steps']} timed steps, collectives {cfg.get('collectives', 'sockets')}\n"
        )
        print(memory_table(report) if args.memory else speed_table(report))


if __name__ == "__main__":
    main()
