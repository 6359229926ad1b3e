"""Rematerialisation at a realistic batch, side by side in one run: fsdp_fn without remat,
with full and with selective remat, torch FSDP2, and FSDP2 with activation checkpointing
(``torch.distributed._composable.checkpoint``) on every block; and, tuned against tuned,
fsdp_fn with full remat and every memory lever and FSDP2 with activation checkpointing,
both with the chunked loss head (``fsdp_fn.chunked_cross_entropy``, ``--chunks``).

Same GPT, data and world size for every system. Reports per system the median step time
(max over ranks), the peak live tensor bytes per rank by category (one meter for all:
fsdp_fn.MemoryMeter), torch's own tracker's peak for the same step (``MemTracker`` without
module hooks for fsdp_fn, ``FSDPMemTracker`` for FSDP2), and the operator running when
the peak was reached.

    python bench/remat.py                     # W=2, bench GPT, sequence 256, batch 8 per rank
    python bench/remat.py --world 4 --json out/remat_w4.json
    python bench/remat.py --d-model 128 --layers 2 --vocab 512 --seq 64 --batch 2 --steps 1 --reps 1   # quick
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from compare import Config, OpsOnlyTracker, _batches, fsdp2_rule
from torch.distributed._tools.mem_tracker import MemTracker

import fsdp_fn as ff
from examples.gpt import GPT, Block, lm_loss, lm_loss_chunked, stdlib_text
from fsdp_fn.testing import RankPool

# name -> (remat, memory levers: split_root + update_in_backward, chunked loss head)
FSDP_FN = {
    "fsdp_fn": (None, False, False),
    "fsdp_fn+full": (ff.Remat(), False, False),
    "fsdp_fn+selective": (ff.Remat(policy=ff.save_dots), False, False),
    "fsdp_fn+full+levers": (ff.Remat(), True, False),
    "fsdp_fn+full+levers+chunked": (ff.Remat(), True, True),
}
# name -> (activation checkpointing on every block, chunked loss head)
FSDP2 = {"fsdp2": (False, False), "fsdp2+ac": (True, False), "fsdp2+ac+chunked": (True, True)}
SYSTEMS = (*FSDP_FN, *FSDP2)
LEVERS = {
    "fsdp_fn": "make_plan defaults (split_root='auto')",
    "fsdp_fn+full": "remat=Remat() (full)",
    "fsdp_fn+selective": "remat=Remat(policy=save_dots)",
    "fsdp_fn+full+levers": "full remat, split_root=True, update_in_backward=True",
    "fsdp_fn+full+levers+chunked": "full remat, split_root=True, update_in_backward=True, chunked loss head",
    "fsdp2": "fully_shard per block and root",
    "fsdp2+ac": "fully_shard per block and root, composable checkpoint per block",
    "fsdp2+ac+chunked": "fully_shard per block and root, composable checkpoint per block, chunked loss head",
}


def _build(system: str, cfg: Config, group: Any, chunks: int) -> tuple[Any, Any, Any]:
    """(run_one_step(batch) -> loss, tag(meter), tracker(batch) -> torch's MemTracker) for a system on this rank."""
    torch.manual_seed(0)
    if system in FSDP_FN:
        remat, levers, chunked = FSDP_FN[system]
        full = GPT(cfg.gpt())
        with torch.device("meta"):
            model = GPT(cfg.gpt())
        # Without the levers: make_plan's default (split_root="auto"), as a user gets it.
        plan = ff.make_plan(model, ff.layer_policy([Block]), **({"split_root": True} if levers else {}))
        params = ff.shard(dict(full.named_parameters()), plan, group)
        buffers = dict(full.named_buffers())
        del full
        options: dict[str, Any] = {"update_in_backward": levers}
        if remat is not None:
            options["remat"] = remat
        loss_fn = functools.partial(lm_loss_chunked, chunks=chunks) if chunked else lm_loss
        step = ff.train_step(ff.functionalize(model), loss_fn, ff.adamw(lr=cfg.lr), **options)
        holder = {"state": step.init(params, buffers)}

        def run(batch: torch.Tensor) -> torch.Tensor:
            holder["state"], metrics = step(holder["state"], batch)
            return metrics["loss"]

        def fsdp_fn_tracker(batch: torch.Tensor) -> MemTracker:
            from fsdp_fn._memory import _tensors

            t = OpsOnlyTracker()
            t.track_external(*_tensors(holder["state"]), batch)
            return t

        return run, lambda meter: meter.tag(holder["state"], "state"), fsdp_fn_tracker

    from torch.distributed._composable import checkpoint
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    ac, chunked = FSDP2[system]
    model = GPT(cfg.gpt())
    mesh = DeviceMesh.from_group(group, "cpu")
    for block in model.blocks:
        if ac:
            checkpoint(block)  # activation checkpointing first, then sharding (torchtitan's order)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    torch_loss = functools.partial(lm_loss_chunked, chunks=chunks) if chunked else lm_loss

    def run_fsdp2(batch: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = torch_loss(model, batch)
        loss.backward()
        for meter in ff._labels.active:
            meter.tag([p.grad for p in model.parameters() if p.grad is not None], "grads")
        opt.step()
        out = loss.detach().clone()
        dist.all_reduce(out, group=group)
        return out / group.size()

    def tag(meter: ff.MemoryMeter) -> None:
        meter.tag(list(model.parameters()), "params")
        meter.tag([v for s in opt.state.values() for v in s.values() if v.dim() > 0], "optimizer")

    def fsdp2_tracker(batch: torch.Tensor) -> MemTracker:
        t = FSDPMemTracker(model, opt)
        t.track_inputs((batch,))
        return t

    return run_fsdp2, tag, fsdp2_tracker


def run_system(group: Any, system: str, cfg: Config, measure: bool, chunks: int = 8) -> dict[str, Any]:
    rank, world = group.rank(), group.size()
    text = stdlib_text()
    run, tag, tracker = _build(system, cfg, group, chunks)
    times, losses = [], []
    for k in range(cfg.warmup + cfg.steps):
        batch = _batches(text, cfg, k, rank, world, whole=False)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        losses.append(run(batch).item())
        times.append(time.perf_counter() - t0)
    result: dict[str, Any] = {"times": times[cfg.warmup :], "losses": losses}
    if measure:
        batch = _batches(text, cfg, cfg.warmup + cfg.steps, rank, world, whole=False)
        # One step seen by both instruments at once: ours and torch's.
        torch_tracker = tracker(batch)
        with (
            torch_tracker,
            ff.MemoryMeter(rule=fsdp2_rule if system.startswith("fsdp2") else None, timeline=True) as meter,
        ):
            tag(meter)
            run(batch)
        result["torch_tracker_peak"] = torch_tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        peak = meter.peak()
        assert meter.timeline is not None
        at = max(range(len(meter.timeline)), key=lambda i: sum(meter.timeline[i][1].values()))
        result.update(peak=peak, category_peaks=meter.category_peaks(), peak_op=meter.timeline[at][0])
        result["peak_at"] = f"op {at} of {len(meter.timeline)}"
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--chunks", type=int, default=8, help="row chunks of the chunked loss head")
    p.add_argument("--json", type=pathlib.Path)
    defaults = dataclasses.replace(Config(), seq=256, batch=8, steps=2)
    for field, default in dataclasses.asdict(defaults).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)
    args = p.parse_args()
    cfg = Config(**{f: getattr(args, f) for f in dataclasses.asdict(defaults)})
    systems = [s for s in args.systems.split(",") if s]
    if set(systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(set(systems) - set(SYSTEMS))}; choose from {SYSTEMS}")
    params = sum(p.numel() for p in GPT(cfg.gpt()).parameters())
    print(
        f"GPT {params / 1e6:.1f}M params, W={args.world}, {cfg.batch}x{cfg.seq} tokens per rank, "
        f"{args.threads} thread(s) per rank, {args.reps} reps x {cfg.steps} steps; CPU, gloo",
        flush=True,
    )
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    with RankPool(args.world, threads=args.threads, timeout=3600, warnings_as_errors=False) as pool:
        for rep in range(args.reps):
            for system in systems:
                per_rank = pool.run(run_system, system, cfg, rep == 0, args.chunks, world=args.world, timeout=3600)
                step_max = [max(ts) for ts in zip(*(r["times"] for r in per_rank), strict=True)]
                runs[system].append({"step_s": step_max, **{k: v for k, v in per_rank[0].items() if k != "times"}})
                print(f"  rep {rep + 1} {system:>20}: median step {statistics.median(step_max):.2f} s", flush=True)

    report: dict[str, Any] = {
        "world": args.world,
        "params": params,
        "chunks": args.chunks,
        "config": dataclasses.asdict(cfg),
        "systems": {},
    }
    for system, reps in runs.items():
        first = reps[0]
        report["systems"][system] = {
            "step_s_median": statistics.median(t for r in reps for t in r["step_s"]),
            "levers": LEVERS[system],
            **{k: first[k] for k in ("peak", "category_peaks", "torch_tracker_peak", "peak_op", "peak_at", "losses")},
        }
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


def print_report(report: dict[str, Any]) -> None:
    mib = 2**20
    cats = ff.CATEGORIES
    systems = report["systems"]
    print(f"\nW={report['world']}; peak live tensor bytes per rank (MiB) at the step's peak; CPU, gloo")
    print(
        f"{'system':>28} {'step s':>7} "
        + " ".join(f"{c[:9]:>9}" for c in cats)
        + f" {'total':>8} {'torch':>8}  peak during"
    )
    for name, s in systems.items():
        peak = s["peak"]
        print(
            f"{name:>28} {s['step_s_median']:>7.2f} "
            + " ".join(f"{peak[c] / mib:>9.1f}" for c in cats)
            + f" {peak['total'] / mib:>8.1f} {s['torch_tracker_peak'] / mib:>8.1f}  {s['peak_op']} ({s['peak_at']})"
        )
    print(f"  (torch: the peak torch's MemTracker / FSDPMemTracker saw in the same step; chunks={report['chunks']})")
    for name, s in systems.items():
        print(f"  {name}: {s['levers']}")
    for name, s in systems.items():  # the chunked loss head changes memory, not the training
        plain = systems.get(name.removesuffix("+chunked")) if name.endswith("+chunked") else None
        if plain is not None:
            diff = max(abs(a - b) for a, b in zip(s["losses"], plain["losses"], strict=True))
            print(f"  {name}: losses differ from {name.removesuffix('+chunked')}'s by at most {diff:.2e}")
    tuned, tuned_fsdp2 = systems.get("fsdp_fn+full+levers+chunked"), systems.get("fsdp2+ac+chunked")
    if tuned and tuned_fsdp2:
        print(
            f"  tuned against tuned: fsdp_fn+full+levers+chunked is "
            f"{tuned['peak']['total'] / tuned_fsdp2['peak']['total']:.2f} x the peak of fsdp2+ac+chunked, "
            f"{tuned['step_s_median'] / tuned_fsdp2['step_s_median']:.2f} x its step time"
        )
    ac = systems.get("fsdp2+ac")
    if ac:
        for name, s in systems.items():
            print(
                f"  {name}: {s['peak']['total'] / ac['peak']['total']:.2f} x the peak of FSDP2 + AC, "
                f"{s['step_s_median'] / ac['step_s_median']:.2f} x its step time"
            )


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
