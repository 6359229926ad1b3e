"""Side by side, in one run: fsdp_fn, torch FSDP2, torch FSDP1, DDP and one process.

Same GPT, same data, same world size; systems interleaved, each repetition running every
system once. Reports per system the median step time (max over ranks), tokens/s, peak
live tensor bytes per rank by category (one meter for all: fsdp_fn.MemoryMeter),
collective bytes per step per rank (ring model) and the loss after each step.

    python bench/compare.py                      # W=2, the 33.7M-parameter GPT
    python bench/compare.py --world 4 --json out/w4.json
    python bench/compare.py --d-model 128 --layers 2 --vocab 512 --steps 3 --reps 1   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss, stdlib_text, token_batches
from fsdp_fn.testing import RankPool

SYSTEMS = ("fsdp_fn", "fsdp2", "fsdp1", "ddp", "single")


@dataclass(frozen=True)
class Config:
    d_model: int = 512
    layers: int = 8
    heads: int = 8
    vocab: int = 8192
    seq: int = 128
    batch: int = 2  # sequences per rank
    steps: int = 4  # timed steps per repetition
    warmup: int = 1
    lr: float = 3e-4
    # fsdp_fn's memory levers (see docs/memory.md); 0 turns one off
    split_root: int = 1
    update_in_backward: int = 1
    max_inflight: int = 2
    device: str = "cpu"  # "cuda": NCCL, one GPU per rank, MFU reported

    def gpt(self) -> GPTConfig:
        return GPTConfig(vocab=self.vocab, seq=self.seq, d_model=self.d_model, n_layers=self.layers, n_heads=self.heads)


# --- communication: every c10d op that passes the dispatcher --------------------------------


class CommMeter(TorchDispatchMode):
    """Bytes each rank sends per step, in the ring model for collectives.

    A collective over a full buffer of B bytes counts (W-1)/W * B (2x for all-reduce); a
    point-to-point send counts its bytes. DDP's all-reduces come from C++ and are not
    seen by a dispatch mode: its figure is the model (2 (W-1)/W * gradient bytes).
    """

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world, self.bytes, self.ops = world, 0.0, 0

    @staticmethod
    def _nbytes(x: Any) -> int:
        items = x if isinstance(x, list | tuple) else [x]
        return sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if not name.startswith("c10d.") or self.world == 1:
            return out
        self.ops += 1
        share = (self.world - 1) / self.world
        if name.startswith("c10d.send"):
            self.bytes += self._nbytes(args[0])
        elif "recv" in name or "barrier" in name:
            pass
        elif "reduce_scatter" in name:
            self.bytes += share * self._nbytes(args[1])
        elif "allreduce" in name:
            self.bytes += 2 * share * self._nbytes(args[0])
        else:  # all-gather, broadcast: the first argument is the full (output) buffer
            self.bytes += share * self._nbytes(args[0])
        return out


def fsdp2_rule(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[tuple[torch.Tensor, str]]:
    """FSDP2's internals: where its gathered parameters and communication buffers come from."""
    name = str(func)
    if "split_with_sizes_copy" in name:
        return [(t, "gathered") for t in kwargs.get("out", args[-1] if isinstance(args[-1], list) else [])]
    if "all_gather_copy_in" in name or "chunk_cat" in name:
        return [(t, "comm") for t in (out if isinstance(out, tuple | list) else [out]) if isinstance(t, torch.Tensor)]
    return []


# --- one system on this rank ------------------------------------------------------------------


def _batches(text: bytes, cfg: Config, k: int, rank: int, world: int, whole: bool) -> torch.Tensor:
    if whole:  # the global batch: every rank's part, in rank order
        return torch.cat([token_batches(text, cfg.batch, cfg.seq, seed=k * world + r) for r in range(world)])
    return token_batches(text, cfg.batch, cfg.seq, seed=k * world + rank)


def _build(system: str, cfg: Config, group: Any) -> tuple[Any, Any, Any]:
    """(run_one_step(batch) -> loss tensor (this rank's), tag(meter), module) for a system."""
    torch.manual_seed(0)
    device = torch.device(cfg.device, torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    if system == "fsdp_fn":
        # The same initial weights as the other systems; the module itself lives on meta, so
        # after sharding no rank holds the full model (as after FSDP2's fully_shard).
        full = GPT(cfg.gpt()).to(device)
        with torch.device("meta"):
            model = GPT(cfg.gpt())
        plan = ff.make_plan(model, ff.layer_policy([Block]), split_root=cfg.split_root)
        params = ff.shard(dict(full.named_parameters()), plan, group)
        buffers = dict(full.named_buffers())
        del full
        fn = ff.functionalize(model)
        step = ff.train_step(
            fn, lm_loss, ff.adamw(lr=cfg.lr), update_in_backward=cfg.update_in_backward, max_inflight=cfg.max_inflight
        )
        holder = {"state": step.init(params, buffers)}

        def run(batch: torch.Tensor) -> torch.Tensor:
            holder["state"], metrics = step(holder["state"], batch)
            return metrics["loss"]

        return run, lambda meter: meter.tag(holder["state"], "state"), model

    model = GPT(cfg.gpt()).to(device)
    if system == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, device.type)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    elif system == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        wrapped = FullyShardedDataParallel(
            model, process_group=group, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu")
        )
    elif system == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=group, gradient_as_bucket_view=True)
    else:
        wrapped = model
    opt = torch.optim.AdamW(wrapped.parameters(), lr=cfg.lr)  # torch's default kernel choice
    world = group.size() if group is not None else 1

    def run(batch: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(wrapped, batch)
        loss.backward()
        for meter in ff._memory._active:
            meter.tag([p.grad for p in wrapped.parameters() if p.grad is not None], "grads")
        opt.step()
        out = loss.detach().clone()
        if system != "single":
            dist.all_reduce(out, group=group)
            out /= world
        return out

    def tag(meter: ff.MemoryMeter) -> None:
        meter.tag(list(wrapped.parameters()), "params")
        meter.tag(
            [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0],
            "optimizer",
        )
        meter.tag(list(wrapped.buffers()), "buffers")
        if system == "fsdp1":
            from torch.distributed.fsdp import _traversal_utils

            for handle in _traversal_utils._get_fsdp_handles(wrapped):
                if hasattr(handle.flat_param, "_full_param_padded"):  # absent with NO_SHARD (W=1)
                    meter.tag(handle.flat_param._full_param_padded, "gathered")

    return run, tag, wrapped


def activation_floor(model: torch.nn.Module, batch: torch.Tensor) -> int:
    """Live bytes a plain forward leaves for backward (activations, logits, loss) at this batch."""
    with ff.MemoryMeter() as meter:
        # Tagged, so that views of the weights (a linear's transpose) are not counted as activations.
        meter.tag(list(model.parameters()), "params")
        meter.tag(list(model.buffers()), "buffers")
        loss = lm_loss(model, batch)
        meter.sample("end of forward")
    live = meter.current["activations"]
    loss.backward()
    model.zero_grad(set_to_none=True)
    return live


def _sync(cfg: Config) -> None:
    if cfg.device == "cuda":
        torch.cuda.synchronize()


def run_system(group: Any, system: str, cfg: Config, world: int, measure: bool) -> dict[str, Any]:
    rank = group.rank()
    text = stdlib_text()
    run, tag, module = _build(system, cfg, group)
    whole = system == "single"
    times, losses = [], []
    for k in range(cfg.warmup + cfg.steps):
        batch = _batches(text, cfg, k, rank, world, whole).to(cfg.device)
        if group.size() > 1:
            dist.barrier(group=group)
        _sync(cfg)
        t0 = time.perf_counter()
        loss = run(batch)
        _sync(cfg)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    result: dict[str, Any] = {"times": times[cfg.warmup :], "losses": losses}
    if measure:
        k = cfg.warmup + cfg.steps
        batch = _batches(text, cfg, k, rank, world, whole=False).to(cfg.device)  # memory at the per-rank batch
        rule = fsdp2_rule if system == "fsdp2" else None
        with CommMeter(world) as comm, ff.MemoryMeter(rule=rule) as meter:
            tag(meter)
            run(batch)
        if system == "single":
            result["activation_floor"] = activation_floor(module, batch)
        result["peak"] = meter.peak()
        result["category_peaks"] = meter.category_peaks()
        result["comm_bytes"] = comm.bytes
        if system == "ddp":  # its all-reduces are issued from C++, out of the dispatch mode's sight
            result["comm_bytes"] = (
                2 * (world - 1) / world * sum(p.numel() * p.element_size() for p in module.parameters())
            )
    return result


# --- the driver ---------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--json", type=pathlib.Path)
    p.add_argument("--peak-tflops", type=float, default=0.0, help="the device's peak (fp32) TFLOP/s, to report MFU")
    for field, default in asdict(Config()).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)
    args = p.parse_args()
    cfg = Config(**{f: getattr(args, f) for f in asdict(Config())})
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    world = args.world
    params = sum(p.numel() for p in GPT(cfg.gpt()).parameters())
    print(
        f"GPT {params / 1e6:.1f}M params, W={world}, {cfg.batch}x{cfg.seq} tokens per rank, "
        f"{args.threads} thread(s) per rank, {args.reps} reps x {cfg.steps} steps",
        flush=True,
    )

    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    started = time.perf_counter()
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    with RankPool(world, threads=args.threads, timeout=1800, warnings_as_errors=False, backend=backend) as pool:
        for rep in range(args.reps):
            for system in systems:
                w = 1 if system == "single" else world
                per_rank = pool.run(run_system, system, cfg, world, rep == 0, world=w, timeout=1800)
                step_max = [max(ts) for ts in zip(*(r["times"] for r in per_rank), strict=True)]
                keep = ("peak", "category_peaks", "comm_bytes", "activation_floor")
                runs[system].append(
                    {
                        "step_s": step_max,
                        "losses": per_rank[0]["losses"],
                        **{k: per_rank[0][k] for k in keep if k in per_rank[0]},
                    }
                )
                print(f"  rep {rep + 1} {system:>8}: median step {statistics.median(step_max):.3f} s", flush=True)

    tokens = cfg.batch * cfg.seq * world
    report: dict[str, Any] = {
        "world": world,
        "params": params,
        "config": {**asdict(cfg), "threads": args.threads, "reps": args.reps},
        "systems": {},
    }
    for system, reps in runs.items():
        all_steps = [t for r in reps for t in r["step_s"]]
        medians = [statistics.median(r["step_s"]) for r in reps]
        med = statistics.median(all_steps)
        report["systems"][system] = {
            "step_s_median": med,
            # Model FLOPs: 6 per parameter per token, plus attention (12 * layers * d_model * seq per token).
            "model_tflops_per_s": (6 * params + 12 * cfg.layers * cfg.d_model * cfg.seq) * tokens / med / 1e12,
            "step_s_rep_medians": medians,
            "tokens_per_s": tokens / med,
            "peak_bytes": reps[0].get("peak"),
            "category_peaks": reps[0].get("category_peaks"),
            "comm_bytes_per_step": reps[0].get("comm_bytes"),
            "losses": reps[0]["losses"],
        }
    floor_state = 16 * params / world
    with torch.device("meta"):
        meta = GPT(cfg.gpt())
    unit = max(u.gather_bytes(world) for u in ff.make_plan(meta, ff.layer_policy([Block]), split_root=True).units)
    report["floor"] = {"state_16psi_over_w": floor_state, "gathered_unit": unit}
    if "single" in runs and "activation_floor" in runs["single"][0]:
        report["floor"]["activations"] = runs["single"][0]["activation_floor"]
    report["elapsed_s"] = time.perf_counter() - started
    if args.peak_tflops:
        for entry in report["systems"].values():
            entry["mfu"] = entry["model_tflops_per_s"] / args.peak_tflops
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


def print_report(report: dict[str, Any]) -> None:
    mib = 2**20
    systems = report["systems"]
    cats = ff.CATEGORIES
    print(
        f"\nW={report['world']}, {report['params'] / 1e6:.1f}M params; peak live tensor bytes per rank (MiB) at the step's peak"
    )
    print(
        f"{'system':>8} {'step s':>8} {'min-max':>13} {'tok/s':>8} {'comm MB':>8} "
        + " ".join(f"{c[:9]:>9}" for c in cats)
        + f" {'total':>8}  loss[-1]"
    )
    for name, s in systems.items():
        peak = s["peak_bytes"] or {}
        lo, hi = min(s["step_s_rep_medians"]), max(s["step_s_rep_medians"])
        comm = s["comm_bytes_per_step"]
        print(
            f"{name:>8} {s['step_s_median']:>8.3f} {lo:>6.3f}-{hi:<6.3f} {s['tokens_per_s']:>8.0f} "
            f"{(comm or 0) / 1e6:>8.1f} "
            + " ".join(f"{peak.get(c, 0) / mib:>9.1f}" for c in cats)
            + f" {peak.get('total', 0) / mib:>8.1f}  {s['losses'][-1]:.4f}"
        )
    floor = report["floor"]
    total = floor["state_16psi_over_w"] + floor.get("activations", 0) + floor["gathered_unit"]
    floor["total"] = total
    print(
        f"floor: 16*psi/W {floor['state_16psi_over_w'] / mib:.1f} + one unit gathered {floor['gathered_unit'] / mib:.1f} "
        f"+ activations {floor.get('activations', 0) / mib:.1f} = {total / mib:.1f} MiB"
    )
    ours = systems.get("fsdp_fn", {}).get("peak_bytes")
    if ours:
        print(f"fsdp_fn peak = {ours['total'] / total:.2f} x floor", end="")
        if systems.get("fsdp2", {}).get("peak_bytes"):
            theirs = systems["fsdp2"]
            print(
                f", {ours['total'] / theirs['peak_bytes']['total']:.2f} x FSDP2; categories above FSDP2's (own maxima): "
                f"{[c for c in cats if systems['fsdp_fn']['category_peaks'][c] > theirs['category_peaks'][c] + 4096] or 'none'} (4 KiB tolerance)",
                end="",
            )
            print(f"; step time {systems['fsdp_fn']['step_s_median'] / theirs['step_s_median']:.2f} x FSDP2", end="")
        if "ddp" in systems:
            print(f", {systems['fsdp_fn']['step_s_median'] / systems['ddp']['step_s_median']:.2f} x DDP", end="")
        print()
    if "single" in systems:
        ref = systems["single"]["losses"]
        for name, s in systems.items():
            if name != "single":
                worst = max(abs(a - b) / abs(b) for a, b in zip(s["losses"], ref))
                print(f"  {name}: max relative loss difference to one process {worst:.2e}")


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
