"""Where a step's time goes, per rank: forward + backward, optimizer, waits, main-thread CPU.

Runs fsdp_fn (defaults) or DDP (``gradient_as_bucket_view``, ``AdamW(foreach=True)``) on
the bench GPT of ``bench/compare.py`` and reports, per rank, the median over the timed
steps of: the step's wall time, its forward + backward and optimizer parts, the main
thread's CPU time (``time.thread_time``: what the step computes itself, not what gloo's
threads or the other ranks take from the cores), the process's CPU time (every thread:
with the cores saturated, the step's wall time follows the sum over ranks), the process's minor page faults (memory
touched for the first time since the allocator took it from the system), and for fsdp_fn
the time its waits on collectives blocked (each wait named with ``--waits``). ``--top N`` adds torch's
profiler's N most expensive operators on rank 0 (self CPU, grouped by input shape).
``--timeline`` prints the last timed step of every rank on one clock: when each exchange
was issued and how long issuing it took, and each wait longer than 0.5 ms.

    python bench/step_profile.py fsdp_fn --world 2
    python bench/step_profile.py ddp --world 2
    python bench/step_profile.py fsdp_fn --world 2 --waits --top 12
    python bench/step_profile.py fsdp_fn --world 2 --timeline
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import resource
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from fsdp_fn import _comm, _guard
from fsdp_fn.testing import RankPool


def _timed(name: str, fn: Any, into: dict[str, list[float]]) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        into[name].append(time.perf_counter() - t0)
        return out

    return call


def profile_rank(group: Any, system: str, steps: int, warmup: int, top: int) -> dict[str, Any]:
    events: list[tuple[str, str, float, float]] = []  # (kind, what, start, end) on the wall clock
    rank = group.rank()
    cfg = GPTConfig(vocab=8192, seq=128, d_model=512, n_layers=8, n_heads=8)
    torch.manual_seed(0)
    full = GPT(cfg)
    parts: dict[str, list[float]] = collections.defaultdict(list)
    waits: list[tuple[str, float]] = []
    if system == "fsdp_fn":
        import fsdp_fn._step as step_module

        original_wait = _guard.Guard.wait

        def wait(self: Any, works: Any, what: str) -> None:
            t0, w0 = time.perf_counter(), time.time()
            original_wait(self, works, what)
            waits.append((what, time.perf_counter() - t0))
            events.append(("wait", what, w0, time.time()))

        _guard.Guard.wait = wait  # type: ignore[method-assign]
        original_exchange = _comm.PairwiseComm.exchange

        def exchange(*args: Any) -> Any:
            w0 = time.time()
            pending = original_exchange(*args)
            events.append(("issue", args[-1], w0, time.time()))
            return pending

        _comm.PairwiseComm.exchange = exchange  # type: ignore[method-assign]
        step_module.lean_pass = _timed("forward+backward", step_module.lean_pass, parts)
        with torch.device("meta"):
            model = GPT(cfg)
        plan = ff.make_plan(model, ff.layer_policy([Block]))
        opt = ff.adamw(lr=3e-4)
        opt = opt._replace(update=_timed("optimizer", opt.update, parts))
        train = ff.train_step(ff.functionalize(model), lm_loss, opt)
        holder = {"state": train.init(ff.shard(dict(full.named_parameters()), plan, group), dict(full.named_buffers()))}

        def step(batch: torch.Tensor) -> None:
            holder["state"], _ = train(holder["state"], batch)

    else:
        ddp = torch.nn.parallel.DistributedDataParallel(full, process_group=group, gradient_as_bucket_view=True)
        torch_opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4, foreach=True)
        forward_backward = _timed("forward+backward", lambda b: lm_loss(ddp, b).backward(), parts)
        optimizer_step = _timed("optimizer", torch_opt.step, parts)

        def step(batch: torch.Tensor) -> None:
            torch_opt.zero_grad(set_to_none=True)
            forward_backward(batch)
            optimizer_step()

    generator = torch.Generator().manual_seed(rank)
    walls, cpus, process_cpus, waited, faults = [], [], [], [], []
    per_wait: dict[tuple[int, str], list[float]] = collections.defaultdict(list)
    for k in range(warmup + steps):
        batch = torch.randint(0, cfg.vocab, (2, cfg.seq + 1), generator=generator)
        dist.barrier(group=group)
        waits.clear()
        events.clear()
        start = time.time()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        step(batch)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
        process_cpus.append(time.process_time() - p0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        waited.append(sum(d for _, d in waits))
        if k >= warmup:
            for i, (what, d) in enumerate(waits):
                per_wait[(i, what)].append(d)
    result: dict[str, Any] = {
        "rank": rank,
        "step": statistics.median(walls[warmup:]),
        "main thread CPU": statistics.median(cpus[warmup:]),
        "process CPU": statistics.median(process_cpus[warmup:]),
        "waits": statistics.median(waited[warmup:]),
        "page faults": statistics.median(faults[warmup:]),
        **{name: statistics.median(times[warmup:]) for name, times in parts.items()},
        "each wait": [(what, statistics.median(d)) for (_, what), d in sorted(per_wait.items())],
        "timeline": (start, list(events)),
    }
    if top:
        from torch.profiler import profile

        with profile(record_shapes=True) as prof:
            for _ in range(3):
                dist.barrier(group=group)
                step(torch.randint(0, cfg.vocab, (2, cfg.seq + 1), generator=generator))
        if rank == 0:
            result["top"] = prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cpu_time_total", row_limit=top
            )
    return result


def print_timeline(results: list[dict[str, Any]]) -> None:
    """Every rank's last step on one clock (ms from the first rank's start)."""
    zero = min(r["timeline"][0] for r in results)
    print("  ms from the step's start, rank, what (issue: the exchange's call; wait: blocked)")
    rows = []
    for r in results:
        start, events = r["timeline"]
        print(f"    rank {r['rank']} started at {(start - zero) * 1e3:.1f}")
        rows += [(a, r["rank"], kind, what, b - a) for kind, what, a, b in events if kind == "issue" or b - a > 5e-4]
    for a, rank, kind, what, took in sorted(rows):
        print(f"  {(a - zero) * 1e3:8.1f}  rank {rank}  {kind:5s} {took * 1e3:5.1f} ms  {what}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("system", choices=("fsdp_fn", "ddp"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--waits", action="store_true", help="list every wait of a step (median per wait)")
    parser.add_argument("--top", type=int, default=0, help="torch profiler's top operators on rank 0")
    parser.add_argument("--timeline", action="store_true", help="the last step of every rank, on one clock")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with RankPool(args.world, threads=1, timeout=3600, warnings_as_errors=False) as pool:
        results = pool.run(profile_rank, args.system, args.steps, args.warmup, args.top, world=args.world)
    print(f"[CPU, gloo] {args.system}, W={args.world}: seconds per step, median over {args.steps} steps")
    for r in results:
        fields = ("step", "forward+backward", "optimizer", "main thread CPU", "process CPU", "waits")
        print(
            f"  rank {r['rank']}: "
            + ", ".join(f"{f} {r[f]:.3f}" for f in fields if f in r)
            + f"; {r['page faults']:.0f} page faults"
        )
    if args.waits:
        for what, d in results[0]["each wait"]:
            print(f"    rank 0 waited {d * 1e3:6.1f} ms on the {what}")
    if args.timeline and args.system == "fsdp_fn":
        print_timeline(results)
    if args.top:
        print(results[0]["top"])


if __name__ == "__main__":
    main()
