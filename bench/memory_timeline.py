"""The memory picture: live tensor bytes by category over one fsdp_fn step, per rank.

    python bench/memory_timeline.py                     # W=2, writes docs/memory_timeline.png
    python bench/memory_timeline.py --world 4 --out out/timeline_w4.png

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
    step = ff.train_step(fn, lm_loss, ff.adamw(), schedule=ff.Schedule(update_in_backward=update_in_backward))
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--plain", action="store_true", help="without split_root / update_in_backward")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/memory_timeline.png"))
    args = p.parse_args()
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=4)
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
        + ("" if args.plain else " (split_root, update_in_backward)")
    )
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}; peaks per rank: {[round(r['peak']['total'] / 2**20, 1) for r in runs]} MiB")


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
