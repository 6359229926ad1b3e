"""Rematerialisation at a realistic batch, side by side in one run: fsdp_fn without remat,
with full and with selective remat, torch FSDP2, and FSDP2 with activation checkpointing
(``torch.distributed._composable.checkpoint``) on every block.

Same GPT, data and world size for every system. Reports per system the median step time
(max over ranks), the peak live tensor bytes per rank by category (one meter for all:
fsdp_fn.MemoryMeter), and the operator running when the peak was reached.

    python bench/remat.py                     # W=2, bench GPT, sequence 256, batch 8 per rank
    python bench/remat.py --world 4 --json out/remat_w4.json
    python bench/remat.py --d-model 128 --layers 2 --vocab 512 --seq 64 --batch 2 --steps 1 --reps 1   # quick
"""

from __future__ import annotations

import argparse
import dataclasses
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

from compare import Config, _batches, fsdp2_rule

import fsdp_fn as ff
from examples.gpt import GPT, Block, lm_loss, stdlib_text
from fsdp_fn.testing import RankPool

# name -> (remat, memory levers: split_root + update_in_backward)
FSDP_FN = {
    "fsdp_fn": (None, False),
    "fsdp_fn+full": (ff.Remat(), False),
    "fsdp_fn+selective": (ff.Remat(policy=ff.save_dots), False),
    "fsdp_fn+full+levers": (ff.Remat(), True),
}
SYSTEMS = (*FSDP_FN, "fsdp2", "fsdp2+ac")


def _build(system: str, cfg: Config, group: Any) -> tuple[Any, Any]:
    """(run_one_step(batch) -> loss, tag(meter)) for a system on this rank."""
    torch.manual_seed(0)
    if system in FSDP_FN:
        remat, levers = FSDP_FN[system]
        full = GPT(cfg.gpt())
        with torch.device("meta"):
            model = GPT(cfg.gpt())
        # Without the levers: make_plan's default (split_root="auto"), as a user gets it.
        plan = ff.make_plan(model, ff.layer_policy([Block]), **({"split_root": True} if levers else {}))
        params = ff.shard(dict(full.named_parameters()), plan, group)
        buffers = dict(full.named_buffers())
        del full
        schedule = ff.Schedule(update_in_backward=levers)
        step = ff.train_step(ff.functionalize(model), lm_loss, ff.adamw(lr=cfg.lr), schedule=schedule, remat=remat)
        holder = {"state": step.init(params, buffers)}

        def run(batch: torch.Tensor) -> torch.Tensor:
            holder["state"], metrics = step(holder["state"], batch)
            return metrics["loss"]

        return run, lambda meter: meter.tag(holder["state"], "state")

    from torch.distributed._composable import checkpoint
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = GPT(cfg.gpt())
    mesh = DeviceMesh.from_group(group, "cpu")
    for block in model.blocks:
        if system == "fsdp2+ac":
            checkpoint(block)  # activation checkpointing first, then sharding (torchtitan's order)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    def run_fsdp2(batch: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, batch)
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

    return run_fsdp2, tag


def run_system(group: Any, system: str, cfg: Config, measure: bool) -> dict[str, Any]:
    rank, world = group.rank(), group.size()
    text = stdlib_text()
    run, tag = _build(system, cfg, group)
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
        with ff.MemoryMeter(rule=fsdp2_rule if system.startswith("fsdp2") else None, timeline=True) as meter:
            tag(meter)
            run(batch)
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
                per_rank = pool.run(run_system, system, cfg, rep == 0, world=args.world, timeout=3600)
                step_max = [max(ts) for ts in zip(*(r["times"] for r in per_rank), strict=True)]
                runs[system].append({"step_s": step_max, **{k: v for k, v in per_rank[0].items() if k != "times"}})
                print(f"  rep {rep + 1} {system:>20}: median step {statistics.median(step_max):.2f} s", flush=True)

    report: dict[str, Any] = {"world": args.world, "params": params, "config": dataclasses.asdict(cfg), "systems": {}}
    for system, reps in runs.items():
        first = reps[0]
        report["systems"][system] = {
            "step_s_median": statistics.median(t for r in reps for t in r["step_s"]),
            **{k: first[k] for k in ("peak", "category_peaks", "peak_op", "peak_at", "losses")},
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
    print(f"{'system':>20} {'step s':>7} " + " ".join(f"{c[:9]:>9}" for c in cats) + f" {'total':>8}  peak during")
    for name, s in systems.items():
        peak = s["peak"]
        print(
            f"{name:>20} {s['step_s_median']:>7.2f} "
            + " ".join(f"{peak[c] / mib:>9.1f}" for c in cats)
            + f" {peak['total'] / mib:>8.1f}  {s['peak_op']} ({s['peak_at']})"
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
