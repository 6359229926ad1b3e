"""Host cost of a step: a GPT whose math is tiny, so what is left is what a GPU would show.

fsdp_fn, torch FSDP2 (``fully_shard`` on each block and the root) and DDP train the same
tiny GPT (vocab 512, d 64, seq 32, 2 sequences per rank by default) on the same batches, in
one pool of ranks, each repetition in a random order. Reported per system and block count:
the median step (max over ranks), and the cost of one more block (the slope between the
smallest and the largest block count, in microseconds per block per step). For fsdp_fn, the
step's host time split by phase (``fsdp_fn._phases``: the same ranges a user's
``torch.profiler`` trace shows as ``fsdp_fn::<phase>``), checked against torch's profiler on
the same steps (``--check``: both instruments' totals per phase). For every system, the CPU a
step takes per thread (Linux's ``/proc``: the step's thread, gloo's, fsdp_fn's waiter and
sender) and the whole process's: with more busy threads than cores, the step's time follows
their sum. ``--interleave`` builds every system at once and runs one step of each in turn, so
a machine whose speed changes from second to second weighs on each alike (no phase split).

    python bench/overhead.py                                   # W=2, 2 and 16 blocks, CPU, gloo
    python bench/overhead.py --layers 2,8,16 --reps 3 --json out/overhead.json
    python bench/overhead.py --compile                         # every block compiled (block.compile())
    python bench/overhead.py --check                           # phase clock against torch.profiler
    python bench/overhead.py --clock-cost                      # the phase clock's own cost on an empty phase
    python bench/overhead.py --layers 16 --reps 3 --steps 20 --interleave   # a step of each in turn
    python bench/overhead.py --device cuda --world 8 --d-model 1024 --peak-tflops 989   # NCCL, MFU
    python bench/overhead.py --layers 16 --systems fsdp_fn,fsdp_fn@4,fsdp_fn@16,fsdp2@4,ddp  # K blocks a unit
    python bench/overhead.py --layers 16 --systems fsdp_fn,fsdp_fn+sockets --interleave   # the transport

``SYSTEM@K`` groups K consecutive blocks into one unit: fsdp_fn's ``Plan.grouped(K)``,
FSDP2's ``fully_shard(blocks[i:i+K])`` (a list of modules, one parameter group).
``fsdp_fn+sockets`` runs fsdp_fn on a group of its own whose messages go through gloo's
sockets (``ff.PairwiseComm``) instead of shared memory (``ff.SharedMemoryComm``, the default
on one host; ``fsdp_fn+shm`` asks for it on a group of its own): the transport's share of the step.

With ``--compile`` each system's blocks are compiled the way torchtitan users do it
(``block.compile()``; for fsdp_fn before ``functionalize``, for FSDP2 before ``fully_shard``),
and Dynamo's counters are reported: graph breaks, distinct graphs, recompilations after the
warm-up steps.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from fsdp_fn._phases import PHASES, phase_clock, phased
from fsdp_fn.testing import RankPool


@dataclass(frozen=True)
class Config:
    d_model: int = 64
    heads: int = 2
    vocab: int = 512
    seq: int = 32
    batch: int = 2  # sequences per rank
    steps: int = 20  # timed steps per repetition
    warmup: int = 5
    device: str = "cpu"
    compile: bool = False
    check: bool = False


def _device(cfg: Config) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")


def _sync(cfg: Config) -> None:
    if cfg.device == "cuda":
        torch.cuda.synchronize()


def _model(cfg: Config, layers: int) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=cfg.vocab, seq=cfg.seq, d_model=cfg.d_model, n_layers=layers, n_heads=cfg.heads))
    model = model.to(_device(cfg))
    if cfg.compile:
        for block in model.blocks:
            block.compile()
    return model


def _build(system: str, cfg: Config, layers: int, group: Any) -> Any:
    """A function that runs one step on a batch and returns the loss."""
    model = _model(cfg, layers)
    system, _, k = system.partition("@")
    system, _, via = system.partition("+")
    if via:  # a group of its own whose messages go through shared memory, or gloo's sockets
        group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
        ff.set_comm(group, ff.SharedMemoryComm(group) if via == "shm" else ff.PairwiseComm(group))
    per_unit = int(k or 1)  # blocks per unit
    if system == "fsdp_fn":
        fn = ff.functionalize(model)
        plan = ff.make_plan(model, ff.layer_policy([Block])).grouped(per_unit)
        step = ff.train_step(fn, lm_loss, ff.adamw(lr=1e-3))
        holder = {"state": step.init(ff.shard(fn.params, plan, group))}

        def run(batch: torch.Tensor) -> torch.Tensor:
            holder["state"], metrics = step(holder["state"], batch)
            return metrics["loss"]

        return run
    if system == "fsdp_fn_functional":  # the loop a JAX user writes: value_and_grad, update, apply_updates
        fn = ff.functionalize(model)
        plan = ff.make_plan(model, ff.layer_policy([Block])).grouped(per_unit)
        tx = ff.adamw(lr=1e-3)
        grad_fn = ff.value_and_grad(fn, lm_loss)
        params = ff.shard(fn.params, plan, group)
        holder = {"params": params, "opt": tx.init(params)}

        def run(batch: torch.Tensor) -> torch.Tensor:
            loss, grads = grad_fn(holder["params"], fn.buffers, batch)
            updates, holder["opt"] = tx.update(grads, holder["opt"], holder["params"])
            holder["params"] = ff.apply_updates(holder["params"], updates)
            return loss.detach()

        return run
    if system == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, cfg.device)
        blocks = list(model.blocks)
        for at in range(0, len(blocks), per_unit):
            fully_shard(blocks[at : at + per_unit] if per_unit > 1 else blocks[at], mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped: torch.nn.Module = model
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=group, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, foreach=True)

    def run(batch: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(wrapped, batch)
        loss.backward()
        opt.step()
        return loss.detach()

    return run


def _batch(cfg: Config, k: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * k + rank)
    return torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g).to(_device(cfg))


def _dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "recompiles": sum(counters["recompiles"].values()),
    }


def _threads_cpu() -> collections.Counter[str]:
    """The CPU seconds each thread of this process has used so far (Linux's ``/proc``; empty
    elsewhere), threads of one name summed: ``main``, Python's threads by their name, the
    others by the kernel's (gloo's ``gloo_tcp_loop``). A clock tick's resolution (10 ms)."""
    tick = os.sysconf("SC_CLK_TCK")
    named = {t.native_id: t.name for t in threading.enumerate()}
    used: collections.Counter[str] = collections.Counter()
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # (a thread that ended meanwhile)
            continue
        fields = stat.rsplit(")", 1)[1].split()  # (after the name, which may hold spaces)
        name = "main" if int(tid) == os.getpid() else named.get(int(tid), comm)
        used[name] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return used


def run_system(group: Any, system: str, cfg: Config, layers: int) -> dict[str, Any]:
    """Time ``cfg.steps`` steps of one system on this rank (after ``cfg.warmup``)."""
    rank = group.rank()
    if cfg.compile:
        torch._dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
    step = _build(system, cfg, layers, group)
    times, cpus, losses = [], [], []
    k = 0
    for _ in range(cfg.warmup):
        losses.append(float(step(_batch(cfg, k, rank))))
        k += 1
    _sync(cfg)
    after_warmup = _dynamo_counts() if cfg.compile else {}
    threads_before, process_before = _threads_cpu(), time.process_time()
    for _ in range(cfg.steps):
        batch = _batch(cfg, k, rank)
        k += 1
        dist.barrier(group=group)
        _sync(cfg)
        t0, c0 = time.perf_counter(), time.thread_time()
        losses.append(float(step(batch)))
        _sync(cfg)
        times.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    threads = _threads_cpu()
    threads.subtract(threads_before)
    out: dict[str, Any] = {"times": times, "cpus": cpus, "losses": losses}
    out["threads_cpu"] = {name: 1e3 * t / cfg.steps for name, t in threads.items() if t > 0}
    out["process_cpu"] = 1e3 * (time.process_time() - process_before) / cfg.steps
    if cfg.compile:
        now = _dynamo_counts()
        out["dynamo"] = {**now, "recompiles_after_warmup": now["recompiles"] - after_warmup["recompiles"]}
    if system.startswith("fsdp_fn"):  # the split by phase, over as many more steps
        cpu = 0.0
        with phase_clock() as clock:
            for _ in range(cfg.steps):
                batch = _batch(cfg, k, rank)
                k += 1
                dist.barrier(group=group)
                c0 = time.thread_time()
                step(batch)
                cpu += time.thread_time() - c0
        out["phases"] = {name: 1e3 * clock.seconds[name] / cfg.steps for name in PHASES}
        out["phases_cpu"] = {name: 1e3 * clock.cpu_seconds[name] / cfg.steps for name in PHASES}
        out["phases_cpu"]["(outside phases)"] = 1e3 * (cpu - sum(clock.cpu_seconds.values())) / cfg.steps
        out["phase_calls"] = {name: clock.calls[name] / cfg.steps for name in PHASES}
        if cfg.check:
            out["check"] = _check_against_profiler(step, cfg, k, rank, group)
    return out


def run_interleaved(group: Any, systems: list[str], cfg: Config, layers: int, seed: int) -> dict[str, Any]:
    """Every system built at once, then one step of each in turn (a new random order each
    time), ``cfg.steps`` times: a machine whose speed changes from second to second weighs on
    each system alike. Per system what ``run_system`` reports, but for the phase split."""
    rank = group.rank()
    steps = {system: _build(system, cfg, layers, group) for system in systems}
    out: dict[str, dict[str, Any]] = {
        s: {"times": [], "cpus": [], "losses": [], "threads_cpu": collections.Counter(), "process_cpu": 0.0}
        for s in systems
    }
    k = 0
    for _ in range(cfg.warmup):
        for system in systems:
            out[system]["losses"].append(float(steps[system](_batch(cfg, k, rank))))
        k += 1
    rng = random.Random(seed)  # (the same order on every rank)
    for _ in range(cfg.steps):
        batch = _batch(cfg, k, rank)
        k += 1
        for system in rng.sample(systems, len(systems)):
            mine = out[system]
            dist.barrier(group=group)
            _sync(cfg)
            threads, p0 = _threads_cpu(), time.process_time()
            t0, c0 = time.perf_counter(), time.thread_time()
            mine["losses"].append(float(steps[system](batch)))
            _sync(cfg)
            mine["times"].append(time.perf_counter() - t0)
            mine["cpus"].append(time.thread_time() - c0)
            mine["process_cpu"] += time.process_time() - p0
            mine["threads_cpu"].update(_threads_cpu())
            mine["threads_cpu"].subtract(threads)
    for mine in out.values():
        mine["threads_cpu"] = {n: 1e3 * t / cfg.steps for n, t in mine["threads_cpu"].items() if t > 0}
        mine["process_cpu"] *= 1e3 / cfg.steps
    return out


def _check_against_profiler(step: Any, cfg: Config, k: int, rank: int, group: Any) -> dict[str, Any]:
    """The same steps seen by both instruments: the phase clock's host time per phase and the
    length of torch.profiler's ``fsdp_fn::<phase>`` ranges, both inclusive of what runs inside
    (the profiler's self time also leaves out torch's own operators, which the clock counts)."""
    from torch.profiler import ProfilerActivity, profile

    with phase_clock() as clock, profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(4):
            dist.barrier(group=group)
            step(_batch(cfg, k + i, rank))
    ranges: dict[str, float] = collections.Counter()
    for event in prof.key_averages():
        if event.key.startswith("fsdp_fn::"):
            ranges[event.key.removeprefix("fsdp_fn::")] += event.cpu_time_total / 1e3 / 4
    return {
        "clock_ms": {name: 1e3 * clock.inclusive[name] / 4 for name in PHASES},
        "profiler_ms": {name: ranges.get(name, 0.0) for name in PHASES},
        "profiler_counts": {
            e.key.removeprefix("fsdp_fn::"): e.count / 4 for e in prof.key_averages() if e.key.startswith("fsdp_fn::")
        },
        "clock_counts": {name: clock.calls[name] / 4 for name in PHASES},
    }


def clock_cost(n: int = 20_000) -> dict[str, float]:
    """What the phase clock charges to the phases it times of its own work, in µs of the
    thread's CPU: empty phases timed in a loop, one alone, and one nested in another (the pair)."""

    @phased("wait")
    def inner() -> None:
        pass

    @phased("post_backward")
    def outer() -> None:
        inner()

    @phased("post_backward")
    def alone() -> None:
        pass

    out = {}
    for name, fn in (("alone", alone), ("nested pair", outer)):
        with phase_clock() as clock:
            for _ in range(n):
                fn()
        out[name] = 1e6 * sum(clock.cpu_seconds.values()) / n
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", default="2,16", help="block counts, comma-separated")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--systems", default="fsdp_fn,fsdp2,ddp", help="of fsdp_fn, fsdp_fn_functional, fsdp2, ddp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=pathlib.Path)
    p.add_argument("--peak-tflops", type=float, default=0.0, help="the device's peak TFLOP/s, to report MFU")
    p.add_argument(
        "--interleave", action="store_true", help="every system at once, one step of each in turn (no phase split)"
    )
    for name, default in asdict(Config()).items():
        if isinstance(default, bool):
            p.add_argument(f"--{name.replace('_', '-')}", action="store_true")
        else:
            p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    p.add_argument("--clock-cost", action="store_true", help="only what the phase clock charges to an empty phase")
    args = p.parse_args()
    if args.clock_cost:
        costs = clock_cost()
        print("phase clock, its own work charged to empty phases (µs of the thread's CPU):", end=" ")
        print(", ".join(f"{name} {us:.2f}" for name, us in costs.items()))
        return
    cfg = Config(**{k: getattr(args, k) for k in asdict(Config())})
    systems = args.systems.split(",")
    layer_counts = [int(x) for x in args.layers.split(",")]
    rng = random.Random(args.seed)
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    results: dict[tuple[str, int], list[dict[str, Any]]] = collections.defaultdict(list)
    with RankPool(args.world, threads=args.threads, backend=backend, warnings_as_errors=False) as pool:
        for _ in range(args.reps):
            for layers in layer_counts:
                if args.interleave:
                    ranks = pool.run(run_interleaved, systems, cfg, layers, rng.randrange(1 << 30))
                    for system in systems:
                        results[(system, layers)].append([r[system] for r in ranks])
                    continue
                for system in rng.sample(systems, len(systems)):
                    results[(system, layers)].append(pool.run(run_system, system, cfg, layers))
    report = summarise(results, cfg, systems, layer_counts, args)
    print_report(report, cfg, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


def summarise(
    results: dict[tuple[str, int], list[Any]], cfg: Config, systems: list[str], layers: list[int], args: Any
) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for (system, n), reps in results.items():
        # Per repetition: the median step over the timed steps, the slowest rank's.
        medians = [max(statistics.median(r["times"]) for r in ranks) for ranks in reps]
        cpus = [max(statistics.median(r["cpus"]) for r in ranks) for ranks in reps]
        row: dict[str, Any] = {
            "system": system,
            "layers": n,
            "step_ms": 1e3 * statistics.median(medians),
            "step_ms_reps": [1e3 * m for m in medians],
            "thread_cpu_ms": 1e3 * statistics.median(cpus),
            "loss_last": reps[-1][0]["losses"][-1],
        }
        # Per thread (and the process): each repetition's slowest rank, the median over repetitions.
        names = {name for ranks in reps for r in ranks for name in r["threads_cpu"]}
        row["threads_cpu_ms"] = {
            name: statistics.median(max(r["threads_cpu"].get(name, 0.0) for r in ranks) for ranks in reps)
            for name in sorted(names)
        }
        row["process_cpu_ms"] = statistics.median(max(r["process_cpu"] for r in ranks) for ranks in reps)
        if "phases" in reps[-1][0]:
            row["phases_ms"] = {
                name: statistics.median(max(r["phases"][name] for r in ranks) for ranks in reps) for name in PHASES
            }
            row["phase_calls"] = reps[-1][0]["phase_calls"]
            row["phases_cpu_ms"] = {
                name: statistics.median(max(r["phases_cpu"][name] for r in ranks) for ranks in reps)
                for name in reps[-1][0]["phases_cpu"]
            }
        if "dynamo" in reps[-1][0]:
            row["dynamo"] = reps[-1][0]["dynamo"]
        if "check" in reps[-1][0]:
            row["check"] = reps[-1][0]["check"]
        if args.peak_tflops:
            model = _model(Config(**{**asdict(cfg), "device": "cpu", "compile": False}), n)
            params = sum(p.numel() for p in model.parameters())
            tokens = cfg.batch * cfg.seq * args.world
            row["mfu"] = 6 * params * tokens / (row["step_ms"] / 1e3) / (args.peak_tflops * 1e12 * args.world)
        rows[f"{system}@{n}"] = row
    slopes = {}
    if len(layers) > 1:
        lo, hi = min(layers), max(layers)
        for system in systems:
            a, b = rows.get(f"{system}@{lo}"), rows.get(f"{system}@{hi}")
            if a and b:
                slopes[system] = 1e3 * (b["step_ms"] - a["step_ms"]) / (hi - lo)
    return {
        "config": asdict(cfg),
        "world": args.world,
        "platform": f"{cfg.device}, {'nccl' if cfg.device == 'cuda' else 'gloo'}, W={args.world}",
        "rows": rows,
        "us_per_block": slopes,
    }


def print_report(report: dict[str, Any], cfg: Config, args: Any) -> None:
    rows = report["rows"]
    print(
        f"# host cost, {report['platform']}, tiny GPT (d {cfg.d_model}, vocab {cfg.vocab}, seq {cfg.seq} x {cfg.batch})"
    )
    print(f"{'system':18} {'blocks':>6} {'step ms':>9} {'per rep':>22} {'thread cpu ms':>14}")
    for row in sorted(rows.values(), key=lambda r: (r["layers"], r["system"])):
        reps = ", ".join(f"{m:.1f}" for m in row["step_ms_reps"])
        extra = f"  MFU {100 * row['mfu']:.1f}%" if "mfu" in row else ""
        print(
            f"{row['system']:18} {row['layers']:>6} {row['step_ms']:>9.1f} {reps:>22} {row['thread_cpu_ms']:>14.1f}{extra}"
        )
    for n in sorted({r["layers"] for r in rows.values()}):
        ours, fsdp2, ddp = (rows.get(f"{s}@{n}") for s in ("fsdp_fn", "fsdp2", "ddp"))
        if ours and fsdp2 and ddp:
            print(
                f"{n} blocks: fsdp_fn {ours['step_ms'] / fsdp2['step_ms']:.2f}x FSDP2, "
                f"{ours['step_ms'] / ddp['step_ms']:.2f}x DDP"
            )
    for n in sorted({r["layers"] for r in rows.values()}):
        ddp = rows.get(f"ddp@{n}")
        if ddp:
            ratios = [f"{r['system']} {r['step_ms'] / ddp['step_ms']:.2f}x" for r in rows.values() if r["layers"] == n]
            print(f"{n} blocks, x DDP: " + ", ".join(ratios))
    for n in sorted({r["layers"] for r in rows.values()}):
        ours, functional = rows.get(f"fsdp_fn@{n}"), rows.get(f"fsdp_fn_functional@{n}")
        if ours and functional:
            print(f"{n} blocks: functional loop {functional['step_ms'] / ours['step_ms']:.2f}x train_step")
    if report["us_per_block"]:
        print("one more block, us per step: " + ", ".join(f"{s} {v:.0f}" for s, v in report["us_per_block"].items()))
    for row in rows.values():
        by_thread = sorted(row["threads_cpu_ms"].items(), key=lambda kv: -kv[1])
        parts = ", ".join(f"{k} {v:.1f}" for k, v in by_thread if v >= 0.05)
        print(
            f"{row['system']} @{row['layers']} blocks, CPU ms per step by thread: {parts}; "
            f"the process {row['process_cpu_ms']:.1f} (a {row['step_ms']:.1f} ms step)"
        )
    for row in rows.values():
        if "phases_ms" in row:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in row["phases_ms"].items() if v >= 0.005)
            print(f"{row['system']} @{row['layers']} blocks, host ms per step by phase (exclusive): {parts}")
            parts = ", ".join(f"{k} {v:.2f}" for k, v in row["phases_cpu_ms"].items() if v >= 0.005)
            print(f"{row['system']} @{row['layers']} blocks, the step thread's CPU ms per step by phase: {parts}")
            own = sum(v for k, v in row["phases_cpu_ms"].items() if k in PHASES)
            print(
                f"{row['system']} @{row['layers']} blocks, own phases: {own:.2f} ms of the step thread's CPU a step, "
                f"{own / row['layers']:.3f} ms a block (each phase the slowest rank's)"
            )
        if "dynamo" in row:
            print(f"{row['system']} @{row['layers']} blocks, Dynamo: {row['dynamo']}")
        if "check" in row:
            check = row["check"]
            print(f"fsdp_fn @{row['layers']} blocks, per phase, inclusive: phase clock ms / torch.profiler ms / calls")
            for name in PHASES:
                if check["clock_counts"].get(name) or check["profiler_counts"].get(name):
                    print(
                        f"    {name:15} {check['clock_ms'][name]:7.2f} {check['profiler_ms'][name]:7.2f}  "
                        f"{check['clock_counts'][name]:6.1f} {check['profiler_counts'].get(name, 0):6.1f}"
                    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
