"""One change measured against its absence in the same ranks: steps alternate between the two.

Separate runs of a benchmark drift by a few % on this machine (another tenant, the CPU's
clock), more than the changes now left to measure. Here the same ranks run the bench GPT
of ``bench/compare.py`` (2x128 tokens per rank) at fsdp_fn's defaults and switch a change on and off every two
steps, so both arms see the same drift. Reported: the median and mean step time (max
over ranks, after a barrier) of each arm, over the timed steps.

    python bench/alternate.py sender --world 2 --steps 60

Changes:

- ``sender``: the pairwise exchanges' sends leave from fsdp_fn's sender thread (on) or
  from the step's own thread (off), see ``fsdp_fn/_comm.py``; the group on gloo's sockets
  (``PairwiseComm``), not the default shared memory, whose sends have a thread of their own.
- ``pieces``: the optimizer steps each shard in cache-sized pieces (on) or whole (off),
  see ``fsdp_fn/_optim.py``.
- ``tail``: the units that ran last stay gathered for backward while they fit the in-flight
  cap (on, ``Schedule.keep_tail_gathered``) or the last unit alone (off), see
  ``fsdp_fn/_prefetch.py``.
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from fsdp_fn import _comm, _optim, _prefetch
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


CHANGES: dict[str, Callable[[bool], None]] = {"sender": _sender, "pieces": _pieces, "tail": _tail}


def run(group: Any, change: str, steps: int, warmup: int, cfg: GPTConfig) -> dict[str, list[float]]:
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
    times: dict[str, list[float]] = {"on": [], "off": []}
    for k in range(warmup + steps):
        on = (k // 2) % 2 == 0
        CHANGES[change](on)
        batch = torch.randint(0, cfg.vocab, (2, cfg.seq + 1), generator=generator)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        state, _ = train(state, batch)
        took = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
        if k >= warmup:
            times["on" if on else "off"].append(took.item())
    CHANGES[change](True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("change", choices=sorted(CHANGES))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    cfg = GPTConfig(vocab=args.vocab, seq=128, d_model=args.d_model, n_layers=args.layers, n_heads=8)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with RankPool(args.world, threads=1, timeout=3600, warnings_as_errors=False) as pool:
        times = pool.run(run, args.change, args.steps, args.warmup, cfg, world=args.world)[0]
    size = f"d_model {cfg.d_model}, {cfg.n_layers} layers, vocab {cfg.vocab}"
    print(f"[CPU, gloo] {args.change}, W={args.world}, {size}: alternating every two steps, {args.steps} timed steps")
    for arm in ("on", "off"):
        t = times[arm]
        print(f"  {arm:3s}: median {statistics.median(t):.4f} s, mean {statistics.mean(t):.4f} s over {len(t)} steps")
    print(f"  on / off: {statistics.median(times['on']) / statistics.median(times['off']):.3f} (medians)")


if __name__ == "__main__":
    main()
