"""The memory picture: live tensor bytes by category over one fsdp_fn step, per rank.

    python bench/memory_timeline.py                     # W=2, writes docs/memory_timeline.png
    python bench/memory_timeline.py --world 4 --out out/timeline_w4.png
    python bench/memory_timeline.py --remat             # without remat | with full remat, side by side,
                                                        # writes docs/memory_timeline_remat.png
    python bench/memory_timeline.py --remat --remats none,full,selective --out out/remat.png   # + selective

With ``--remat`` (the bench GPT, sequence 256, batch 8 per rank by default) it also prints,
per configuration, ``estimate_memory`` with ``estimate_activations`` (one fake step, made
before anything is allocated) beside the meter's peak on a real step.

Every op of the step is one point on the x axis; categories are stacked. The per-unit
gather/free sawtooth shows in "gathered": each block is gathered just before it runs,
freed after its forward, gathered again just before its backward.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss, stdlib_text, token_batches
from fsdp_fn.testing import RankPool


def measure(group: Any, cfg: GPTConfig, batch: int, split_root: bool, update_in_backward: bool) -> dict[str, Any]:
    rank, world = group.rank(), group.size()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    plan = ff.make_plan(model, ff.layer_policy([Block]), split_root=split_root)
    params, buffers = ff.init_shards(model, plan, group)
    fn = ff.functionalize(model)
    # The memory levers: update_in_backward, and only the last unit kept gathered for backward.
    lean = ff.Schedule(update_in_backward=update_in_backward, keep_tail_gathered=not update_in_backward)
    step = ff.train_step(fn, lm_loss, ff.adamw(), schedule=lean)
    state = step.init(params, buffers)
    text = stdlib_text()
    state, _ = step(state, token_batches(text, batch, cfg.seq, seed=rank))
    tokens = token_batches(text, batch, cfg.seq, seed=world + rank)
    meter = ff.MemoryMeter(timeline=True)
    with meter:
        meter.tag(state, "state")
        state, _ = step(state, tokens)
    assert meter.timeline is not None
    return {"timeline": [c for _, c in meter.timeline], "peak": meter.peak()}


REMATS = {"none": None, "full": ff.Remat(), "selective": ff.Remat(policy=ff.save_dots)}


def measure_remat(group: Any, cfg: GPTConfig, batch: int, remat: str) -> dict[str, Any]:
    """One step of fsdp_fn at its defaults with ``remat``: the meter's timeline and peak, and the estimate."""
    rank, world = group.rank(), group.size()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    plan = ff.make_plan(model, ff.layer_policy([Block]))
    fn = ff.functionalize(model)
    text = stdlib_text()
    tokens = token_batches(text, batch, cfg.seq, seed=world + rank)
    schedule = ff.Schedule()
    activations = ff.estimate_activations(fn, lm_loss, tokens, plan, remat=REMATS[remat])
    estimate = ff.estimate_memory(plan, world, activations=activations, units_in_flight=schedule.max_inflight)
    params, buffers = ff.init_shards(model, plan, group)
    step = ff.train_step(fn, lm_loss, ff.adamw(), schedule=schedule, remat=REMATS[remat])
    state = step.init(params, buffers)
    state, _ = step(state, token_batches(text, batch, cfg.seq, seed=rank))
    meter = ff.MemoryMeter(timeline=True)
    with meter:
        meter.tag(state, "state")
        state, _ = step(state, tokens)
    assert meter.timeline is not None
    at = max(range(len(meter.timeline)), key=lambda i: sum(meter.timeline[i][1].values()))
    return {
        "timeline": [c for _, c in meter.timeline],
        "peak": meter.peak(),
        "peak_op": meter.timeline[at][0],
        "category_peaks": meter.category_peaks(),
        "estimate": estimate,
        "estimate_op": activations.peak_op,
    }


def remat_figure(args: argparse.Namespace, cfg: GPTConfig) -> None:
    names = [r for r in args.remats.split(",") if r]
    if set(names) - set(REMATS):
        raise SystemExit(f"unknown --remats {sorted(set(names) - set(REMATS))}; choose from {sorted(REMATS)}")
    with RankPool(args.world, threads=1, timeout=3600, warnings_as_errors=False) as pool:
        runs = {name: pool.run(measure_remat, cfg, args.batch, name, timeout=3600)[0] for name in names}

    mib = 2**20
    print(f"rank 0, W={args.world}, {args.batch}x{cfg.seq} tokens per rank; MiB; CPU, gloo")
    print(f"{'remat':>10} {'estimate':>9} {'measured':>9} {'est. act.':>9} {'act.':>9}  measured peak during")
    for name, run in runs.items():
        est = run["estimate"]
        print(
            f"{name:>10} {est.total / mib:>9.1f} {run['peak']['total'] / mib:>9.1f} "
            f"{est.activations / mib:>9.1f} {run['category_peaks']['activations'] / mib:>9.1f}  "
            f"{run['peak_op']} (estimated: {run['estimate_op']})"
        )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [n for n in ("none", "full") if n in runs] or names[:2]
    order = ("params", "optimizer", "buffers", "gathered", "grads", "comm", "activations")
    cats = [c for c in order if any(point[c] for n in shown for point in runs[n]["timeline"])]
    fig, axes = plt.subplots(1, len(shown), figsize=(11, 3.8), sharey=True, squeeze=False)
    titles = {"none": "without remat", "full": "full remat (remat=True)", "selective": "remat=Remat(policy=save_dots)"}
    for ax, name in zip(axes[0], shown, strict=True):
        run = runs[name]
        series = [[point[c] / mib for point in run["timeline"]] for c in cats]
        ax.stackplot(range(len(run["timeline"])), series, labels=cats, linewidth=0)
        ax.axhline(run["estimate"].total / mib, color="black", linestyle="--", linewidth=0.8, label="estimate_memory")
        totals = [sum(point.values()) / mib for point in run["timeline"]]
        at = max(range(len(totals)), key=totals.__getitem__)  # a one-op spike: marked, or it may not render
        ax.plot([at], [totals[at]], marker="v", color="black", markersize=5)
        ax.annotate(
            run["peak_op"].removeprefix("aten.").removesuffix(".default"),
            (at, totals[at]),
            xytext=(6, 2),
            textcoords="offset points",
            fontsize=7,
        )
        ax.set_title(f"{titles[name]}: peak {run['peak']['total'] / mib:.0f} MiB", fontsize=10)
        ax.set_xlabel("ops of one train step")
    axes[0, 0].set_ylabel("MiB live, rank 0")
    axes[0, -1].legend(loc="upper right", fontsize=7, ncol=2)
    params = sum(p.numel() for p in GPT(cfg).parameters())
    fig.suptitle(
        f"fsdp_fn, GPT {params / 1e6:.1f}M params, {cfg.n_layers} blocks, {args.batch}x{cfg.seq} tokens per rank, "
        f"W={args.world}; CPU, gloo",
        fontsize=10,
    )
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--d-model", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument(
        "--plain", action="store_true", help="without split_root / update_in_backward / keep_tail_gathered=False"
    )
    p.add_argument("--remat", action="store_true", help="fsdp_fn's defaults without and with remat, side by side")
    p.add_argument("--remats", default="none,full", help=f"with --remat: which of {sorted(REMATS)}")
    p.add_argument("--out", type=pathlib.Path)
    args = p.parse_args()
    # Defaults: a small GPT for the lifecycle picture; the bench GPT at a realistic batch for remat.
    size = (
        {"d_model": 512, "layers": 8, "vocab": 8192, "seq": 256, "batch": 8}
        if args.remat
        else {"d_model": 256, "layers": 6, "vocab": 4096, "seq": 128, "batch": 2}
    )
    for k, v in size.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.out is None:
        args.out = pathlib.Path("docs/memory_timeline_remat.png" if args.remat else "docs/memory_timeline.png")
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=4)
    if args.remat:
        remat_figure(args, cfg)
        return
    with RankPool(args.world, warnings_as_errors=False) as pool:
        runs = pool.run(measure, cfg, args.batch, not args.plain, not args.plain)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = ("params", "optimizer", "buffers", "gathered", "grads", "comm", "activations")  # steady ones at the bottom
    cats = [c for c in order if any(r["timeline"][i][c] for r in runs for i in range(len(r["timeline"])))]
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.2 * len(runs)), sharex=True, squeeze=False)
    for rank, (ax, run) in enumerate(zip(axes[:, 0], runs, strict=True)):
        series = [[point[c] / 2**20 for point in run["timeline"]] for c in cats]
        ax.stackplot(range(len(run["timeline"])), series, labels=cats, linewidth=0)
        ax.set_ylabel("MiB live")
        ax.set_title(f"rank {rank}: peak {run['peak']['total'] / 2**20:.1f} MiB", fontsize=10)
    axes[0, 0].legend(loc="upper left", ncol=len(cats), fontsize=8)
    axes[-1, 0].set_xlabel("ops of one train step (forward, backward, optimizer)")
    params = sum(p.numel() for p in GPT(cfg).parameters())
    fig.suptitle(
        f"fsdp_fn, GPT {params / 1e6:.1f}M params, {cfg.n_layers} blocks, W={args.world}"
        + ("" if args.plain else " (split_root, update_in_backward, keep_tail_gathered=False)")
    )
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}; peaks per rank: {[round(r['peak']['total'] / 2**20, 1) for r in runs]} MiB")


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
