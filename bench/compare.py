"""Side by side, in one run: fsdp_fn, torch FSDP2, torch FSDP1, DDP and one process.

Same GPT, same data, same world size, same work: every system sees the same batches, and
every torch system steps the same AdamW implementation (``foreach``). Comparisons are like
for like: fsdp_fn at its defaults against FSDP2 at its defaults, and fsdp_fn with its
memory levers (``split_root``, ``update_in_backward``, ``keep_tail_gathered=False``) against FSDP2 laid out as
torchtitan lays it out (embedding and head in their own groups, the last block and the head
not resharded after forward). Each repetition runs every system once, in a random order,
with ``--warmup`` untimed and ``--steps`` timed steps.

Reports per system: median step time (max over ranks) and its spread over repetitions,
the step's CPU floor (every rank's CPU time, all its threads, over the machine's cores: the
least wall time the step could take on them), tokens/s, peak live tensor bytes per rank by category (one meter for all,
``fsdp_fn.MemoryMeter``, checked in the same step against torch's ``FSDPMemTracker`` /
``MemTracker``), collective bytes per step per rank (ring model), and, step by step, the
loss and the global gradient norm against one process on the global batch.

    python bench/compare.py                                  # W=2, 33.7M params, 2x128 tokens per rank
    python bench/compare.py --world 4 --json out/w4.json
    python bench/compare.py --table realistic                # seq 256, batch 8 per rank, remat rows
    python bench/compare.py --collectives native             # fsdp_fn on gloo's own collectives
    python bench/compare.py --systems fsdp_fn,ddp,ddp-bucket_view   # DDP tuned (bucket views) and at its defaults
    python bench/compare.py --d-model 128 --layers 2 --vocab 512 --steps 2 --warmup 1 --reps 1   # quick
    python bench/compare.py --systems fsdp_fn,fsdp2,single --freeze blocks.7.,head   # fine-tuning: a frozen tail
    python bench/compare.py --device cuda --world 8 --peak-tflops 67 --json out/cuda.json        # NCCL, MFU

Systems are rows of ``SYSTEMS`` (a kind and its options): add a row to compare another
setting, e.g. ``System("fsdp2", {"checkpoint": True})`` for activation checkpointing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import pathlib
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss, lm_loss_chunked, stdlib_text, token_batches
from fsdp_fn import _shm
from fsdp_fn.testing import RankPool

CORES = len(os.sched_getaffinity(0))  # the cores every rank of a run shares (one machine)


@dataclass(frozen=True)
class System:
    """One row of the comparison: a kind of system (``BUILDERS``) and its options."""

    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    about: str = ""


SYSTEMS: dict[str, System] = {
    "fsdp_fn": System("fsdp_fn", {}, "fsdp_fn at its defaults"),
    "fsdp_fn+split_root": System("fsdp_fn", {"split_root": True}, "fsdp_fn, split_root only"),
    "fsdp_fn-split_root": System("fsdp_fn", {"split_root": False}, "fsdp_fn, the root kept whole (the old default)"),
    "fsdp_fn+levers": System(
        "fsdp_fn",
        {"split_root": True, "update_in_backward": True, "keep_tail_gathered": False},
        "fsdp_fn, split_root + update_in_backward + keep_tail_gathered=False",
    ),
    "fsdp2": System("fsdp2", {}, "FSDP2 at its defaults: fully_shard on each block and the root"),
    "fsdp2+tuned": System(
        "fsdp2",
        {"torchtitan": True},
        "FSDP2 as torchtitan: embedding, each block, [final norm, head] in own groups; last block and head kept",
    ),
    "fsdp_fn+remat": System(
        "fsdp_fn", {"remat": ff.Remat()}, "fsdp_fn, full remat of every block (defaults otherwise)"
    ),
    "fsdp_fn+selective": System(
        "fsdp_fn", {"remat": ff.Remat(policy=ff.save_dots)}, "fsdp_fn, selective remat: matmul outputs saved"
    ),
    "fsdp_fn+remat+levers": System(
        "fsdp_fn",
        {"split_root": True, "update_in_backward": True, "keep_tail_gathered": False, "remat": ff.Remat()},
        "fsdp_fn, full remat + split_root + update_in_backward + keep_tail_gathered=False",
    ),
    "fsdp_fn+remat+levers+chunked": System(
        "fsdp_fn",
        {"split_root": True, "update_in_backward": True, "keep_tail_gathered": False, "remat": ff.Remat(), "chunks": 8},
        "fsdp_fn, full remat + split_root + update_in_backward + keep_tail_gathered=False + the loss head in 8 "
        "chunks (chunked_cross_entropy)",
    ),
    "fsdp2+ac": System(
        "fsdp2", {"checkpoint": True}, "FSDP2 at its defaults + activation checkpointing on every block"
    ),
    "fsdp2+tuned+ac": System(
        "fsdp2",
        {"torchtitan": True, "checkpoint": True},
        "FSDP2 as torchtitan, with activation checkpointing on every block",
    ),
    "fsdp2+ac+chunked": System(
        "fsdp2",
        {"checkpoint": True, "chunks": 8},
        "FSDP2 + activation checkpointing on every block + the loss head in 8 chunks (chunked_cross_entropy)",
    ),
    "fsdp1": System("fsdp1", {}, "FSDP1, one FlatParameter per block and the root"),
    "ddp": System("ddp", {}, "DDP, gradient_as_bucket_view"),
    "ddp-bucket_view": System(
        "ddp", {"bucket_view": False}, "DDP at its defaults: gradients copied into its all-reduce buckets"
    ),
    "single": System("single", {}, "one process on the global batch"),
}
# The pairs compared in the headline: (fsdp_fn row, FSDP2 row).
PAIRS = (
    ("fsdp_fn", "fsdp2"),
    ("fsdp_fn+levers", "fsdp2+tuned"),
    ("fsdp_fn+remat", "fsdp2+ac"),
    ("fsdp_fn+selective", "fsdp2+ac"),
    ("fsdp_fn+remat+levers", "fsdp2+ac"),
    ("fsdp_fn+remat+levers+chunked", "fsdp2+ac"),
    ("fsdp_fn+remat+levers+chunked", "fsdp2+ac+chunked"),
    ("fsdp_fn+remat+levers", "fsdp2+tuned+ac"),
)
# The default rows of each table: the small batch (parameters dominate) and the realistic
# one (sequence 256, batch 8 per rank: activations dominate, so remat rows join).
TABLES = {
    "small": ("fsdp_fn", "fsdp_fn+levers", "fsdp2", "fsdp2+tuned", "fsdp1", "ddp", "single"),
    "realistic": (
        "fsdp_fn",
        "fsdp_fn+remat",
        "fsdp_fn+selective",
        "fsdp_fn+remat+levers",
        "fsdp_fn+remat+levers+chunked",
        "fsdp2",
        "fsdp2+ac",
        "fsdp2+ac+chunked",
        "single",
    ),
}


@dataclass(frozen=True)
class Config:
    d_model: int = 512
    layers: int = 8
    heads: int = 8
    vocab: int = 8192
    seq: int = 128
    batch: int = 2  # sequences per rank
    steps: int = 8  # timed steps per repetition
    warmup: int = 2
    lr: float = 3e-4
    # fsdp_fn on gloo: "shared" (sends and receives through shared memory: SharedMemoryComm, the
    # default), "sockets" (the same through gloo's sockets), or "native" (gloo's own collectives)
    collectives: str = "shared"
    device: str = "cpu"  # "cuda": NCCL, one GPU per rank, MFU reported
    freeze: str = ""  # comma-separated parameter name prefixes frozen in every system (fine-tuning)

    def gpt(self) -> GPTConfig:
        return GPTConfig(vocab=self.vocab, seq=self.seq, d_model=self.d_model, n_layers=self.layers, n_heads=self.heads)

    def frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with the parameters ``freeze`` names set to ``requires_grad=False``."""
        prefixes = tuple(p for p in self.freeze.split(",") if p)
        for name, param in model.named_parameters():
            if prefixes and name.startswith(prefixes):
                param.requires_grad_(False)
        return model


# --- communication: every c10d op that passes the dispatcher --------------------------------


class CommMeter(TorchDispatchMode):
    """Bytes each rank sends per step, in the ring model for collectives.

    A collective over a full buffer of B bytes counts (W-1)/W * B (2x for all-reduce); a
    point-to-point send counts its bytes. DDP's all-reduces come from C++ and are not
    seen by a dispatch mode: its figure is the model (2 (W-1)/W * gradient bytes).
    """

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world, self.collective_bytes, self.sent_bytes = world, 0.0, 0
        self._send: Any = None

    @property
    def bytes(self) -> float:
        return self.collective_bytes + self.sent_bytes

    # fsdp_fn's sends leave from the step's thread or its sender thread, through the process
    # group's own send, out of this dispatch mode's sight: they are counted where every
    # point-to-point send passes, ``ProcessGroup.send``, on whichever thread; or, through
    # shared memory (``SharedMemoryComm``, the default on one host), where each exchange is issued.
    def __enter__(self) -> CommMeter:
        group_class = torch._C._distributed_c10d.ProcessGroup
        self._send = group_class.__dict__["send"]  # (the descriptor: put back as it was, it binds again)
        call = group_class.send

        def send(group: Any, tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            if self.world > 1:
                self.sent_bytes += self._nbytes(tensors)
            return call(group, tensors, *args, **kwargs)

        group_class.send = send
        exchange = self._exchange = _shm.SharedMemoryComm._exchange

        def through_rings(comm: Any, link: Any, sends: Any, recvs: Any, what: Any) -> Any:
            self.sent_bytes += self._nbytes([t for t in sends if t is not None])
            return exchange(comm, link, sends, recvs, what)

        _shm.SharedMemoryComm._exchange = through_rings  # type: ignore[method-assign]
        return cast(CommMeter, super().__enter__())

    def __exit__(self, *exc: Any) -> None:
        torch._C._distributed_c10d.ProcessGroup.send = self._send
        _shm.SharedMemoryComm._exchange = self._exchange  # type: ignore[method-assign]
        super().__exit__(*exc)

    @staticmethod
    def _nbytes(x: Any) -> int:
        items = x if isinstance(x, list | tuple) else [x]
        return sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if not name.startswith("c10d.") or self.world == 1:
            return out
        share = (self.world - 1) / self.world
        if name.startswith("c10d.send") or "recv" in name or "barrier" in name:  # sends: counted in ProcessGroup.send
            pass
        elif "reduce_scatter" in name:
            self.collective_bytes += share * self._nbytes(args[1])
        elif "allreduce" in name:
            self.collective_bytes += 2 * share * self._nbytes(args[0])
        else:  # all-gather, broadcast: the first argument is the full (output) buffer
            self.collective_bytes += share * self._nbytes(args[0])
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


class OpsOnlyTracker(MemTracker):
    """torch's ``MemTracker`` without its per-module hooks, for fsdp_fn: under ``torch.func`` a
    module's parameters are functorch wrappers without storage, which those hooks read."""

    def _pre_fw_hook(self, *args: Any) -> None:
        pass

    def _post_fw_hook(self, *args: Any) -> None:
        pass

    def _pre_bw_hook(self, *args: Any) -> None:
        pass

    def _post_bw_hook(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _frozen_parameters_tolerated() -> Iterator[None]:
    """torch's ``MemTracker``/``FSDPMemTracker`` register gradient hooks on every parameter of
    each module they see, which raises for a frozen one (torch 2.13). Within this block, such
    a hook on a tensor that needs no gradient is not registered: no gradient comes to count."""
    names = ("register_hook", "register_post_accumulate_grad_hook")
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def skipping_frozen(original: Callable[..., Any]) -> Callable[..., Any]:
        def register(self: torch.Tensor, hook: Any) -> Any:
            if not self.requires_grad:
                return torch.utils.hooks.RemovableHandle(collections.OrderedDict())
            return original(self, hook)

        return register

    for name, original in originals.items():
        setattr(torch.Tensor, name, skipping_frozen(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _batches(text: bytes, cfg: Config, k: int, rank: int, world: int, whole: bool) -> torch.Tensor:
    if whole:  # the global batch: every rank's part, in rank order
        return torch.cat([token_batches(text, cfg.batch, cfg.seq, seed=k * world + r) for r in range(world)])
    return token_batches(text, cfg.batch, cfg.seq, seed=k * world + rank)


@dataclass
class Built:
    """A system ready to step on this rank.

    ``step(batch)`` -> (this rank's loss, the global gradient norm, the wall and CPU seconds
    spent on the norm, which the timing leaves out for torch's systems: it is the bench's,
    not theirs).
    """

    step: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, tuple[float, float]]]
    tag: Callable[[ff.MemoryMeter], None]
    tracker: Callable[[torch.Tensor], MemTracker]
    module: torch.nn.Module


def _device(cfg: Config) -> torch.device:
    return torch.device(cfg.device, torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")


def _build_fsdp_fn(cfg: Config, group: Any, **options: Any) -> Built:
    """fsdp_fn: ``split_root`` goes to ``make_plan`` (its default where absent), ``remat`` to
    ``train_step``, ``chunks`` to the loss (``lm_loss_chunked``), the rest are ``Schedule`` fields."""
    device = _device(cfg)
    torch.manual_seed(0)
    # The same initial weights as the other systems; the module itself lives on meta, so
    # after sharding no rank holds the full model (as after FSDP2's fully_shard).
    full = cfg.frozen(GPT(cfg.gpt()).to(device))
    with torch.device("meta"):
        model = cfg.frozen(GPT(cfg.gpt()))
    plan_options = {k: options.pop(k) for k in ("split_root",) if k in options}
    plan = ff.make_plan(model, ff.layer_policy([Block]), **plan_options)
    params = ff.shard(dict(full.named_parameters()), plan, group)
    buffers = dict(full.named_buffers())
    del full
    remat, loss_fn = options.pop("remat", None), _loss(options.pop("chunks", 0))
    schedule = ff.Schedule(**options)
    train = ff.train_step(ff.functionalize(model), loss_fn, ff.adamw(lr=cfg.lr), schedule=schedule, remat=remat)
    holder = {"state": train.init(params, buffers)}

    def step(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[float, float]]:
        holder["state"], metrics = train(holder["state"], batch)
        return metrics["loss"], metrics["grad_norm"], (0.0, 0.0)

    def tracker(batch: torch.Tensor) -> MemTracker:
        from fsdp_fn._memory import _tensors

        t = OpsOnlyTracker()
        t.track_external(*_tensors(holder["state"]), batch)
        return t

    return Built(step, lambda meter: meter.tag(holder["state"], "state"), tracker, model)


def _loss(chunks: int) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The bench's loss: whole, or (``chunks`` > 0) the loss head that many rows at a time."""
    return functools.partial(lm_loss_chunked, chunks=chunks) if chunks else lm_loss


def _build_torch(
    kind: str,
    cfg: Config,
    group: Any,
    torchtitan: bool = False,
    checkpoint: bool = False,
    chunks: int = 0,
    bucket_view: bool = True,
) -> Built:
    device = _device(cfg)
    torch.manual_seed(0)
    model = cfg.frozen(GPT(cfg.gpt()).to(device))
    if checkpoint:  # activation checkpointing on every block (composable: works with FSDP2 and DDP)
        from torch.distributed._composable import checkpoint as composable_checkpoint

        for block in model.blocks:
            composable_checkpoint(block)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, device.type)
        if torchtitan:
            fully_shard(model.wte, mesh=mesh)
            last = len(model.blocks) - 1
            for i, block in enumerate(model.blocks):
                fully_shard(block, mesh=mesh, reshard_after_forward=i < last)  # backward needs the last first
            fully_shard([model.ln_f, model.head], mesh=mesh, reshard_after_forward=False)
        else:
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        wrapped = FullyShardedDataParallel(
            model, process_group=group, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device
        )
    elif kind == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, process_group=group, gradient_as_bucket_view=bucket_view
        )
    else:
        wrapped = model
    opt = torch.optim.AdamW(wrapped.parameters(), lr=cfg.lr, foreach=True)
    loss_fn = _loss(chunks)
    world = group.size() if group is not None else 1
    sharded = kind in ("fsdp1", "fsdp2") and world > 1

    def grad_norm() -> torch.Tensor:
        """The global gradient norm, in float64 (FSDP's gradients are shards: sum over ranks)."""
        square = torch.zeros((), dtype=torch.float64, device=device)
        for p in wrapped.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                square += g.double().square().sum()
        if sharded:
            dist.all_reduce(square, group=group)
        return square.sqrt()

    buckets: list[torch.Tensor] = []

    def step(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[float, float]]:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(wrapped, batch)
        loss.backward()
        grads = [p.grad for p in wrapped.parameters() if p.grad is not None]
        if kind == "ddp" and bucket_view:  # views of DDP's gradient buckets, which outlive zero_grad(set_to_none=True)
            buckets[:] = grads
        for meter in ff._labels.active:
            meter.tag(grads, "grads")
        _sync(cfg)
        t0, c0 = time.perf_counter(), time.process_time()
        norm = grad_norm()
        _sync(cfg)
        spent = (time.perf_counter() - t0, time.process_time() - c0)
        opt.step()
        out = loss.detach().clone()
        if kind != "single":
            dist.all_reduce(out, group=group)
            out /= world
        return out, norm, spent

    def tag(meter: ff.MemoryMeter) -> None:
        meter.tag(list(wrapped.parameters()), "params")
        meter.tag(
            [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0],
            "optimizer",
        )
        meter.tag(list(wrapped.buffers()), "buffers")
        meter.tag(buckets, "grads")
        if kind == "fsdp1":
            from torch.distributed.fsdp import _traversal_utils

            for handle in _traversal_utils._get_fsdp_handles(wrapped):
                if hasattr(handle.flat_param, "_full_param_padded"):  # absent with NO_SHARD (W=1)
                    meter.tag(handle.flat_param._full_param_padded, "gathered")

    def tracker(batch: torch.Tensor) -> MemTracker:
        if kind == "fsdp2":
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            t: MemTracker = FSDPMemTracker(wrapped, opt)
            t.track_inputs((batch,))
            return t
        t = MemTracker()
        t.track_external(wrapped, opt, batch)
        return t

    return Built(step, tag, tracker, wrapped)


BUILDERS: dict[str, Callable[..., Built]] = {
    "fsdp_fn": _build_fsdp_fn,
    "fsdp2": lambda cfg, group, **o: _build_torch("fsdp2", cfg, group, **o),
    "fsdp1": lambda cfg, group, **o: _build_torch("fsdp1", cfg, group, **o),
    "ddp": lambda cfg, group, **o: _build_torch("ddp", cfg, group, **o),
    "single": lambda cfg, group, **o: _build_torch("single", cfg, group, **o),
}


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


def run_system(group: Any, name: str, cfg: Config, world: int, measure: bool) -> dict[str, Any]:
    rank, system = group.rank(), SYSTEMS[name]  # by name: a row's options need not pickle
    text = stdlib_text()
    # fsdp_fn/_collectives.py reads this when a group chooses its comm (at its first collective).
    os.environ["FSDP_FN_COLLECTIVES"] = cfg.collectives
    built = BUILDERS[system.kind](cfg, group, **system.options)
    whole = system.kind == "single"
    times, cpus, losses, norms = [], [], [], []
    for k in range(cfg.warmup + cfg.steps):
        batch = _batches(text, cfg, k, rank, world, whole).to(cfg.device)
        if group.size() > 1:
            dist.barrier(group=group)
        _sync(cfg)
        t0, c0 = time.perf_counter(), time.process_time()
        loss, norm, spent = built.step(batch)
        _sync(cfg)
        times.append(time.perf_counter() - t0 - spent[0])
        cpus.append(time.process_time() - c0 - spent[1])  # every thread of this rank
        losses.append(loss.item())
        norms.append(norm.item())
    result: dict[str, Any] = {
        "times": times[cfg.warmup :],
        "cpus": cpus[cfg.warmup :],
        "losses": losses,
        "grad_norms": norms,
    }
    if measure:
        k = cfg.warmup + cfg.steps
        batch = _batches(text, cfg, k, rank, world, whole=False).to(cfg.device)  # memory at the per-rank batch
        with CommMeter(world) as comm:
            built.step(batch)
        result["comm_bytes"] = comm.bytes
        if system.kind == "ddp":  # its all-reduces are issued from C++, out of the dispatch mode's sight
            params = sum(p.numel() * p.element_size() for p in built.module.parameters())
            result["comm_bytes"] = 2 * (world - 1) / world * params
        if cfg.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        # One step seen by both instruments at once: ours and torch's must agree.
        tracker = built.tracker(batch)
        rule = fsdp2_rule if system.kind == "fsdp2" else None
        tolerated = _frozen_parameters_tolerated() if cfg.freeze else contextlib.nullcontext()
        with tolerated, tracker, ff.MemoryMeter(rule=rule, timeline=True) as meter:
            built.tag(meter)
            built.step(batch)
        assert meter.timeline is not None
        at = max(range(len(meter.timeline)), key=lambda i: sum(meter.timeline[i][1].values()))
        result["peak_op"] = f"{meter.timeline[at][0]} (op {at} of {len(meter.timeline)})"
        meter.timeline = None
        if cfg.device == "cuda":
            result["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
            result["cuda_allocated_before"] = before
        if system.kind == "single":
            result["activation_floor"] = activation_floor(built.module, batch)
        result["peak"] = meter.peak()
        result["category_peaks"] = meter.category_peaks()
        device = _device(cfg)
        result["torch_tracker_peak"] = tracker.get_tracker_snapshot("peak")[device]["Total"]
    return result


# --- the driver ---------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seeds the order of systems in each repetition")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--table", choices=sorted(TABLES), default="small", help="default rows and batch: see TABLES")
    p.add_argument("--systems", default="", help=f"rows of SYSTEMS (default: the table's), from {list(SYSTEMS)}")
    p.add_argument("--json", type=pathlib.Path)
    p.add_argument("--peak-tflops", type=float, default=0.0, help="the device's peak TFLOP/s, to report MFU")
    for name, default in asdict(Config()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    if p.parse_known_args()[0].table == "realistic":
        p.set_defaults(seq=256, batch=8)  # an explicit --seq / --batch still wins
    args = p.parse_args()
    cfg = Config(**{f: getattr(args, f) for f in asdict(Config())})
    if cfg.collectives not in ("shared", "sockets", "native"):
        p.error("--collectives is shared, sockets or native")
    if cfg.warmup < 1 or cfg.steps < 1:
        p.error("at least one warm-up and one timed step")
    systems = [s for s in args.systems.split(",") if s] or list(TABLES[args.table])
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    world = args.world
    params = sum(p.numel() for p in GPT(cfg.gpt()).parameters())
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    platform = f"{cfg.device.upper()}, {backend}"
    print(
        f"[{platform}] GPT {params / 1e6:.1f}M params, W={world}, {cfg.batch}x{cfg.seq} tokens per rank, "
        f"{args.threads} thread(s) per rank, {args.reps} reps x ({cfg.warmup} warm-up + {cfg.steps} timed) steps, "
        f"fsdp_fn collectives: {cfg.collectives if backend == 'gloo' else 'nccl'}"
        + (f", frozen: {cfg.freeze}" if cfg.freeze else ""),
        flush=True,
    )

    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    order_rng = random.Random(args.seed)
    started = time.perf_counter()
    with RankPool(world, threads=args.threads, timeout=3600, warnings_as_errors=False, backend=backend) as pool:
        for rep in range(args.reps):
            order = list(systems)
            order_rng.shuffle(order)
            for name in order:
                system = SYSTEMS[name]
                w = 1 if system.kind == "single" else world
                per_rank = pool.run(run_system, name, cfg, world, rep == 0, world=w, timeout=3600)
                step_max = [max(ts) for ts in zip(*(r["times"] for r in per_rank), strict=True)]
                # The CPU floor: every rank's CPU time (all its threads) over the cores they share.
                # A step cannot take less wall time than that; a step above it has idle cores.
                cpu_floor = [sum(cs) / CORES for cs in zip(*(r["cpus"] for r in per_rank), strict=True)]
                entry: dict[str, Any] = {"step_s": step_max, "cpu_floor_s": cpu_floor, "losses": per_rank[0]["losses"]}
                entry["grad_norms"] = per_rank[0]["grad_norms"]
                if "peak" in per_rank[0]:
                    for key in ("comm_bytes", "activation_floor", "cuda_max_allocated", "cuda_allocated_before"):
                        if key in per_rank[0]:
                            entry[key] = per_rank[0][key]
                    # Memory: the rank with the highest peak (ranks differ only by their data).
                    top = max(per_rank, key=lambda r: r["peak"]["total"])
                    entry.update({k: top[k] for k in ("peak", "category_peaks", "torch_tracker_peak", "peak_op")})
                    entry["meter_vs_tracker_max_abs"] = max(
                        abs(r["peak"]["total"] - r["torch_tracker_peak"]) for r in per_rank
                    )
                runs[name].append(entry)
                print(f"  rep {rep + 1} {name:>20}: median step {statistics.median(step_max):.3f} s", flush=True)

    tokens = cfg.batch * cfg.seq * world
    report: dict[str, Any] = {
        "platform": platform,
        "world": world,
        "params": params,
        "config": {**asdict(cfg), "threads": args.threads, "reps": args.reps, "seed": args.seed, "cores": CORES},
        "systems": {},
    }
    # Model FLOPs per step: 6 per parameter per token, plus attention (12 * layers * d_model * seq per token).
    flops = (6 * params + 12 * cfg.layers * cfg.d_model * cfg.seq) * tokens
    for name, reps in runs.items():
        first = reps[0]
        all_steps = [t for r in reps for t in r["step_s"]]
        med = statistics.median(all_steps)
        report["systems"][name] = {
            "about": SYSTEMS[name].about,
            "step_s_median": med,
            "step_s_rep_medians": [statistics.median(r["step_s"]) for r in reps],
            "cpu_floor_s_median": statistics.median(t for r in reps for t in r["cpu_floor_s"]),
            "tokens_per_s": tokens / med,
            "model_tflops_per_s": flops / med / 1e12,
            "peak_bytes": first.get("peak"),
            "category_peaks": first.get("category_peaks"),
            "peak_op": first.get("peak_op"),
            "torch_tracker_peak_bytes": first.get("torch_tracker_peak"),
            "meter_vs_tracker_max_abs_bytes": first.get("meter_vs_tracker_max_abs"),
            "comm_bytes_per_step": first.get("comm_bytes"),
            "losses": first["losses"],
            "grad_norms": first["grad_norms"],
            **{k: first[k] for k in ("cuda_max_allocated", "cuda_allocated_before") if k in first},
        }
        if args.peak_tflops:
            report["systems"][name]["mfu"] = flops / med / 1e12 / args.peak_tflops
    floor_state = 16 * params / world
    with torch.device("meta"):
        meta = GPT(cfg.gpt())
    unit = max(u.gather_bytes(world) for u in ff.make_plan(meta, ff.layer_policy([Block]), split_root=True).units)
    report["floor"] = {"state_16psi_over_w": floor_state, "gathered_unit": unit}
    if "single" in runs and "activation_floor" in runs["single"][0]:
        report["floor"]["activations"] = runs["single"][0]["activation_floor"]
    report["elapsed_s"] = time.perf_counter() - started
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def print_report(report: dict[str, Any]) -> None:
    mib = 2**20
    systems = report["systems"]
    cats = ff.CATEGORIES
    cfg = report["config"]
    print(
        f"\n[{report['platform']}] W={report['world']}, {report['params'] / 1e6:.1f}M params, "
        f"{cfg['batch']}x{cfg['seq']} tokens per rank; peak live tensor MiB per rank at the step's peak"
    )
    print(
        f"{'system':>20} {'step s':>7} {'rep min-max':>13} {'CPU fl':>7} {'tok/s':>7} {'comm MB':>8} "
        + " ".join(f"{c[:9]:>9}" for c in cats)
        + f" {'total':>7} {'torch':>7}  loss[-1]"
    )
    for name, s in systems.items():
        peak = s["peak_bytes"] or {}
        lo, hi = min(s["step_s_rep_medians"]), max(s["step_s_rep_medians"])
        print(
            f"{name:>20} {s['step_s_median']:>7.3f} {lo:>6.3f}-{hi:<6.3f} {s.get('cpu_floor_s_median', 0):>7.3f} "
            f"{s['tokens_per_s']:>7.0f} "
            f"{(s['comm_bytes_per_step'] or 0) / 1e6:>8.1f} "
            + " ".join(f"{peak.get(c, 0) / mib:>9.1f}" for c in cats)
            + f" {peak.get('total', 0) / mib:>7.1f} {(s['torch_tracker_peak_bytes'] or 0) / mib:>7.1f}"
            + f"  {s['losses'][-1]:.4f}"
        )
    floor = report["floor"]
    total = floor["state_16psi_over_w"] + floor.get("activations", 0) + floor["gathered_unit"]
    floor["total"] = total
    print(
        f"floor: 16*psi/W {floor['state_16psi_over_w'] / mib:.1f} + one unit gathered {floor['gathered_unit'] / mib:.1f} "
        f"+ activations {floor.get('activations', 0) / mib:.1f} = {total / mib:.1f} MiB"
    )
    for name, s in systems.items():
        if s.get("peak_op"):
            print(f"  {name:>20}: peak during {s['peak_op']}")
    worst = max((s["meter_vs_tracker_max_abs_bytes"] or 0) for s in systems.values())
    print(f"meter vs torch's FSDPMemTracker/MemTracker, same step, every rank: max |difference| {worst / mib:.3f} MiB")

    def peak(name: str) -> float | None:
        entry = systems.get(name, {}).get("peak_bytes")
        return entry["total"] if entry else None

    def step(name: str) -> float | None:
        return systems[name]["step_s_median"] if name in systems else None

    for ours, theirs in PAIRS:
        if ours in systems and theirs in systems:
            print(
                f"[{report['platform']}] {ours} vs {theirs}: peak {_ratio(peak(ours), peak(theirs))}, "
                f"step {_ratio(step(ours), step(theirs))}; vs DDP step {_ratio(step(ours), step('ddp'))}"
            )
    if "single" in systems:
        ref_losses, ref_norms = systems["single"]["losses"], systems["single"]["grad_norms"]
        for name, s in systems.items():
            if name != "single":
                loss = max(abs(a - b) / abs(b) for a, b in zip(s["losses"], ref_losses))
                norm = max(abs(a - b) / abs(b) for a, b in zip(s["grad_norms"], ref_norms))
                s["max_rel_diff_to_single"] = {"loss": loss, "grad_norm": norm}
                print(
                    f"  {name:>20}: max relative difference to one process, every step: loss {loss:.1e}, grad norm {norm:.1e}"
                )


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
