"""One change measured against its absence in the same ranks: steps alternate between the two.

Separate runs of a benchmark drift by a few % on this machine (another tenant, the CPU's
clock), more than the changes now left to measure. Here the same ranks run the bench GPT
of ``bench/compare.py`` (2x128 tokens per rank) at fsdp_fn's defaults and switch a change on and off every two
steps, so both arms see the same drift. Reported: the median and mean step time (max
over ranks, after a barrier) of each arm, over the timed steps.

    python bench/alternate.py sender --world 2 --steps 60
    python bench/alternate.py views --d-model 64 --layers 16 --vocab 512 --seq 32 --heads 2 --phases

``--phases`` also reports each arm's step-thread CPU and fsdp_fn's own phases' CPU (a phase
clock open every step, as ``bench/overhead.py``'s split: the median over the arm's steps, the
slowest rank's).

Changes:

- ``sender``: the pairwise exchanges' sends leave from fsdp_fn's sender thread (on) or
  from the step's own thread (off), see ``fsdp_fn/_comm.py``; the group on gloo's sockets
  (``PairwiseComm``), not the default shared memory, whose sends have a thread of their own.
- ``pieces``: the optimizer steps each shard in cache-sized pieces (on) or whole (off),
  see ``fsdp_fn/_optim.py``.
- ``tail``: the units that ran last stay gathered for backward while they fit the in-flight
  cap (on, ``Schedule.keep_tail_gathered``) or the last unit alone (off), see
  ``fsdp_fn/_prefetch.py``.
- ``views``: a parameter's view outside transforms is one C++ call, an ``as_strided`` of the
  unit part's layout (on), or ``_ParamView`` through ``plain_apply`` each (off, as before), see
  ``fsdp_fn/_unit.py``.
- ``refill``: a unit's one output is hooked for its refill on the tensor itself (on) or
  through ``register_multi_grad_hook`` (off, as before), see ``fsdp_fn/_unit.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge, register_multi_grad_hook

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from fsdp_fn import _comm, _optim, _prefetch, _unit
from fsdp_fn._function import plain_apply
from fsdp_fn._phases import phase_clock
from fsdp_fn.testing import RankPool

QUEUED = _comm._QueuedSend


def _sender(on: bool) -> None:
    def inline(tensor: torch.Tensor, group: Any, peer: int) -> Any:
        return dist.isend(tensor, group=group, group_dst=peer, tag=_comm.TAG)

    _comm._QueuedSend = QUEUED if on else inline  # type: ignore[assignment,misc]


PIECE_BYTES = _optim._PIECE_BYTES


def _pieces(on: bool) -> None:
    _optim._PIECE_BYTES = PIECE_BYTES if on else 1 << 62


KEPT_TAIL = _prefetch.kept_tail


def _tail(on: bool) -> None:
    def last_only(order: Any, nbytes: Any, schedule: ff.Schedule) -> int:
        return KEPT_TAIL(order, nbytes, dataclasses.replace(schedule, keep_tail_gathered=False))

    _prefetch.kept_tail = KEPT_TAIL if on else last_only


VIEWS = _unit.GatheredUnit.views
EACH_APPLIED = plain_apply(_unit._ParamView)  # (autograd's C++ entry, as before: no inspect.signature a call)


def _views_each_applied(self: Any, trainable: torch.Tensor) -> dict[str, torch.Tensor]:
    if not torch.is_grad_enabled():
        return VIEWS(self, trainable)
    out = {spec.name: EACH_APPLIED(trainable, self, i) for i, spec in enumerate(self.unit.params)}
    for part in self.parts[1:]:
        out.update(part.views(part.buffer))
    return out


def _views(on: bool) -> None:
    _unit.GatheredUnit.views = VIEWS if on else _views_each_applied  # type: ignore[method-assign]


REFILL = _unit.GatheredUnit.refill_on_backward


def _refill_multi_hooked(self: Any, outputs: list[torch.Tensor]) -> None:
    self.outputs = frozenset(get_gradient_edge(t).node._sequence_nr() for t in outputs)
    register_multi_grad_hook(outputs, lambda _grad: self.pre_backward(), mode="any")


def _refill(on: bool) -> None:
    _unit.GatheredUnit.refill_on_backward = REFILL if on else _refill_multi_hooked  # type: ignore[method-assign]


CHANGES: dict[str, Callable[[bool], None]] = {
    "sender": _sender,
    "pieces": _pieces,
    "tail": _tail,
    "views": _views,
    "refill": _refill,
}


def run(group: Any, change: str, steps: int, warmup: int, cfg: GPTConfig, phases: bool = False) -> dict[str, Any]:
    rank = group.rank()
    if change == "sender":  # (the lever of gloo's sockets)
        ff.set_comm(group, ff.PairwiseComm(group))
    torch.manual_seed(0)
    full = GPT(cfg)
    with torch.device("meta"):
        model = GPT(cfg)
    plan = ff.make_plan(model, ff.layer_policy([Block]))
    train = ff.train_step(ff.functionalize(model), lm_loss, ff.adamw(lr=3e-4))
    state = train.init(ff.shard(dict(full.named_parameters()), plan, group), dict(full.named_buffers()))
    generator = torch.Generator().manual_seed(rank)
    batch_size = 2
    times: dict[str, list[float]] = {"on": [], "off": []}
    cpus: dict[str, list[float]] = {"on": [], "off": []}
    owns: dict[str, list[float]] = {"on": [], "off": []}
    for k in range(warmup + steps):
        on = (k // 2) % 2 == 0
        CHANGES[change](on)
        batch = torch.randint(0, cfg.vocab, (batch_size, cfg.seq + 1), generator=generator)
        dist.barrier(group=group)
        with phase_clock() if phases else contextlib.nullcontext() as clock:
            t0, c0 = time.perf_counter(), time.thread_time()
            state, _ = train(state, batch)
            took = torch.tensor([time.perf_counter() - t0, time.thread_time() - c0, 0.0])
        if clock is not None:
            took[2] = sum(clock.cpu_seconds.values())
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
        if k >= warmup:
            arm = "on" if on else "off"
            times[arm].append(took[0].item())
            cpus[arm].append(took[1].item())
            owns[arm].append(took[2].item())
    CHANGES[change](True)
    return {"times": times, "cpus": cpus, "owns": owns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("change", choices=sorted(CHANGES))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--phases", action="store_true", help="each arm's step-thread CPU and own phases' CPU too")
    args = parser.parse_args()
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with RankPool(args.world, threads=1, timeout=3600, warnings_as_errors=False) as pool:
        out = pool.run(run, args.change, args.steps, args.warmup, cfg, args.phases, world=args.world)[0]
    times = out["times"]
    size = f"d_model {cfg.d_model}, {cfg.n_layers} layers, vocab {cfg.vocab}, seq {cfg.seq}"
    print(f"[CPU, gloo] {args.change}, W={args.world}, {size}: alternating every two steps, {args.steps} timed steps")
    for arm in ("on", "off"):
        t = times[arm]
        line = f"  {arm:3s}: median {statistics.median(t):.4f} s, mean {statistics.mean(t):.4f} s over {len(t)} steps"
        if args.phases:
            cpu, own = statistics.median(out["cpus"][arm]), statistics.median(out["owns"][arm])
            line += f"; the step thread's CPU {1e3 * cpu:.2f} ms, own phases {1e3 * own:.2f} ms"
        print(line)
    print(f"  on / off: {statistics.median(times['on']) / statistics.median(times['off']):.3f} (medians)")


if __name__ == "__main__":
    main()
