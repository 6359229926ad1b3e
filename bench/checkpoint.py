"""Checkpoint save and load, side by side in one run: fsdp_fn.checkpoint and torch FSDP2 + DCP.

Same GPT (33.7M parameters by default), same world size, AdamW state populated by one
step. Per system: save time, load time (median over repetitions of the slowest rank) and
the bytes each rank wrote. For fsdp_fn also what its integrity checks cost: the load
without checking each chunk's digest (``check_digests=False``), the time each save spent
hashing what it wrote, and ``verify(dir)`` of a whole checkpoint on one process; and the
async save: how long ``save(..., blocking=False)`` blocks, and the step time while the
write runs in the background.

    python bench/checkpoint.py --world 2
    python bench/checkpoint.py --world 4 --json out/ckpt_w4.json
    python bench/checkpoint.py --d-model 128 --layers 2 --vocab 512 --reps 1   # quick
    python bench/checkpoint.py --world 2 --export-memory   # MemoryMeter: export/import beyond the shards
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import fsdp_fn as ff
import fsdp_fn.checkpoint as ckpt
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from fsdp_fn.testing import RankPool


def _slowest(seconds: float, group: Any) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _timed(fn: Any, group: Any) -> tuple[float, Any]:
    dist.barrier(group=group)
    start = time.perf_counter()
    out = fn()
    return _slowest(time.perf_counter() - start, group), out


def _bytes_written(directory: pathlib.Path, rank: int) -> int:
    return sum(f.stat().st_size for f in directory.glob(f"__{rank}_*.distcp"))


class _Ours:
    """fsdp_fn: the GPT from the meta device into shards, one AdamW step taken."""

    def __init__(self, group: Any, cfg: GPTConfig, tokens: torch.Tensor) -> None:
        with torch.device("meta"):
            self.model = GPT(cfg)
        self.group, self.tokens = group, tokens
        self.plan = ff.make_plan(self.model, ff.layer_policy([Block]), split_root=True)
        self.step = ff.train_step(ff.functionalize(self.model), lm_loss, ff.adamw(lr=1e-4))
        self.state, _ = self.step(self.step.init(*ff.init_shards(self.model, self.plan, group)), tokens)

    def save(self, d: pathlib.Path) -> None:
        ckpt.save(d, self.state)

    def template(self) -> None:
        """The target to load into, as a run that restarts builds it (not timed: FSDP2's is its model)."""
        self.like = self.step.init(*ff.init_shards(self.model, self.plan, self.group, device="meta"))

    def load(self, d: pathlib.Path, check_digests: bool = True) -> None:
        self.state, _ = ckpt.load(d, self.like, check_digests=check_digests)

    def async_cost(self, d: pathlib.Path) -> dict[str, float]:
        """How long ``save(blocking=False)`` blocks, and a step alone and while the write runs."""
        plain = []
        for _ in range(2):
            seconds, (self.state, _) = _timed(lambda: self.step(self.state, self.tokens), self.group)
            plain.append(seconds)
        blocked, _ = _timed(lambda: ckpt.save(d, self.state, blocking=False), self.group)
        during, (self.state, _) = _timed(lambda: self.step(self.state, self.tokens), self.group)
        ckpt.wait()
        return {"blocks": blocked, "step": min(plain), "step_during_write": during}


class _Theirs:
    """torch FSDP2 on the same GPT, AdamW, one step taken; saved and loaded as torch documents it."""

    def __init__(self, group: Any, cfg: GPTConfig, tokens: torch.Tensor) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        self.model, self.group = GPT(cfg), group
        mesh = DeviceMesh.from_group(group, "cpu")
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        lm_loss(self.model, tokens).backward()
        self.opt.step()

    def template(self) -> None:
        pass

    def save(self, d: pathlib.Path) -> None:
        from torch.distributed.checkpoint import save as dcp_save
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        dcp_save({"model": msd, "optim": osd}, checkpoint_id=d, process_group=self.group)

    def load(self, d: pathlib.Path) -> None:
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        dcp_load({"model": msd, "optim": osd}, checkpoint_id=d, process_group=self.group)
        set_state_dict(self.model, self.opt, model_state_dict=msd, optim_state_dict=osd)


def _run(group: Any, cfg: GPTConfig, root: str, reps: int) -> dict[str, Any]:
    from fsdp_fn.checkpoint import _integrity

    writers: list[Any] = []  # every Writer a save makes, for the seconds it spent hashing
    make = _integrity.Writer.__init__

    def recorded(self: Any, *args: Any, **kwargs: Any) -> None:
        make(self, *args, **kwargs)
        writers.append(self)

    _integrity.Writer.__init__ = recorded  # type: ignore[method-assign]
    rank = group.rank()
    tokens = torch.randint(0, cfg.vocab, (1, cfg.seq + 1), generator=torch.Generator().manual_seed(rank))
    systems = {"fsdp_fn": _Ours(group, cfg, tokens), "fsdp2": _Theirs(group, cfg, tokens)}
    out: dict[str, Any] = {name: {"save": [], "load": []} for name in systems}
    out["fsdp_fn"].update(hashing=[], verify=[])
    for kind in ("load_checked", "load_unchecked", "load_checked_cpu", "load_unchecked_cpu"):
        out["fsdp_fn"][kind] = []
    ours = systems["fsdp_fn"]
    for r in range(reps):  # interleaved, so a noisy machine slows both alike
        for name, system in systems.items():
            d = pathlib.Path(root) / f"{name}_{r}"
            out[name]["save"].append(_timed(lambda s=system, d=d: s.save(d), group)[0])
            out[name]["bytes"] = _bytes_written(d, rank)
        out["fsdp_fn"]["hashing"].append(_slowest(writers[-1].hashing_seconds, group))
        for name, system in systems.items():
            d = pathlib.Path(root) / f"{name}_{r}"
            system.template()
            out[name]["load"].append(_timed(lambda s=system, d=d: s.load(d), group)[0])
        d = pathlib.Path(root) / f"fsdp_fn_{r}"
        for check in (True, False):  # CPU seconds too: on a shared machine they vary less than wall time
            ours.template()
            cpu = time.process_time()
            seconds = _timed(lambda d=d, c=check: ours.load(d, check_digests=c), group)[0]
            cpu_seconds = _slowest(time.process_time() - cpu, group)
            kind = "load_checked" if check else "load_unchecked"
            out["fsdp_fn"][kind].append(seconds)
            out["fsdp_fn"][f"{kind}_cpu"].append(cpu_seconds)
        dist.barrier(group=group)
        start = time.perf_counter()
        if rank == 0:
            ckpt.verify(d)
        out["fsdp_fn"]["verify"].append(time.perf_counter() - start)
        dist.barrier(group=group)
    out["async"] = ours.async_cost(pathlib.Path(root) / "fsdp_fn_async")  # type: ignore[attr-defined]
    return out


def _export_memory(group: Any, cfg: GPTConfig, root: str) -> dict[str, int]:
    """Peak live bytes beyond the shards (``MemoryMeter``) while exporting to safetensors,
    importing them back, and gathering a state dict to rank 0 (measured on the other ranks)."""
    with torch.device("meta"):
        model = GPT(cfg)
    plan = ff.make_plan(model, ff.layer_policy([Block]), split_root=True)
    params, _ = ff.init_shards(model, plan, group)
    own = sum(t.numel() * t.element_size() for t in params.values())
    out = {"largest_unit": max(u.gather_bytes() for u in plan.units), "shards": own}
    with ff.MemoryMeter() as meter:
        meter.tag(params, "params")
        ckpt.export_safetensors(pathlib.Path(root) / "hf", params, max_shard_size=50 << 20)
    out["export"] = meter.peak()["total"] - meter.peak()["params"]
    like, _ = ff.init_shards(model, plan, group, device="meta")
    with ff.MemoryMeter() as meter:
        back = ckpt.import_safetensors(pathlib.Path(root) / "hf", like)
    out["import"] = meter.peak()["total"] - sum(t.numel() * t.element_size() for t in back.values())
    with ff.MemoryMeter() as meter:
        meter.tag(back, "params")
        ckpt.export_state_dict(back)
    out["state_dict"] = meter.peak()["total"] - meter.peak()["params"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dir", type=pathlib.Path, default=None, help="where checkpoints go (default: a temporary dir)")
    p.add_argument("--json", type=pathlib.Path)
    p.add_argument("--export-memory", action="store_true", help="measure the streamed export/import instead")
    args = p.parse_args()
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="fsdp_fn_ckpt_bench_"))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        with RankPool(args.world, timeout=3600, warnings_as_errors=False) as pool:
            if args.export_memory:
                mib = 2**20
                for r, m in enumerate(pool.run(_export_memory, cfg, str(root))):
                    print(
                        f"rank {r}: shards {m['shards'] / mib:.1f} MiB, largest unit gathered "
                        f"{m['largest_unit'] / mib:.1f} MiB; beyond the shards: export_safetensors "
                        f"{m['export'] / mib:.2f} MiB, import_safetensors {m['import'] / mib:.2f} MiB, "
                        f"export_state_dict {m['state_dict'] / mib:.2f} MiB"
                    )
                return
            ranks = pool.run(_run, cfg, str(root), args.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    numel = sum(p.numel() for p in GPT(cfg).parameters())
    report = {"world": args.world, "parameters": numel, "ranks": ranks}
    print(f"GPT {numel / 1e6:.1f}M parameters, W={args.world}, CPU, gloo; median of {args.reps} (slowest rank)")
    print("| system | save s | load s | bytes written per rank (MiB) |")
    print("|---|---|---|---|")
    for system in ("fsdp_fn", "fsdp2"):
        r0 = ranks[0][system]
        per_rank = ", ".join(f"{r[system]['bytes'] / 2**20:.1f}" for r in ranks)
        print(f"| {system} | {statistics.median(r0['save']):.3f} | {statistics.median(r0['load']):.3f} | {per_rank} |")
    ours = ranks[0]["fsdp_fn"]
    gib = sum(r["fsdp_fn"]["bytes"] for r in ranks) / 2**30
    print(
        f"fsdp_fn integrity ({gib:.2f} GiB written): load {statistics.median(ours['load_checked']):.3f} s with each chunk's "
        f"digest checked, {statistics.median(ours['load_unchecked']):.3f} s without (check_digests=False); CPU "
        f"seconds of the busiest rank {statistics.median(ours['load_checked_cpu']):.3f} with, "
        f"{statistics.median(ours['load_unchecked_cpu']):.3f} without; "
        f"hashing at save {statistics.median(ours['hashing']):.3f} s (slowest rank); verify(dir) on one process "
        f"{statistics.median(ours['verify']):.3f} s"
    )
    a = ranks[0]["async"]
    print(
        f"fsdp_fn async save: blocks {a['blocks']:.3f} s; step {a['step']:.3f} s alone, "
        f"{a['step_during_write']:.3f} s while the write runs"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
