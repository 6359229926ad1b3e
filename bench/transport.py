"""What one pairwise exchange costs on this host: gloo's send and receive against shared memory.

Two ranks swap a buffer of ``--kilobytes`` (by default a tiny GPT block's shard at W=2,
100 KB), as ``PairwiseComm`` does for an all-gather, ``--reps`` times: through gloo
(``isend``/``irecv`` over TCP loopback, waited on), and through a pair of shared-memory slots
with a pipe byte to say a slot is written (double-buffered: a rank writes a slot again only
after the peer said it read it). Reported per rank: the time an exchange takes, the CPU of
the rank's main thread, and of the whole process (gloo's loop thread included). The second is
what a ``Comm`` for ranks on one host could cost (``set_comm``), as NCCL's shared-memory
transport does on a GPU host; fsdp_fn does not ship one.

    python bench/transport.py                       # CPU, W=2, 100 KB, 2000 exchanges
    python bench/transport.py --kilobytes 1024 --reps 500
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from fsdp_fn.testing._pool import _free_port


def _rank(
    rank: int, slots: list[torch.Tensor], pipes: list[Connection], port: int, n: int, reps: int, out: Any
) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peer = 1 - rank
    mine = torch.full((n,), float(rank + 1))
    gathered = torch.empty(2 * n)
    theirs = gathered[peer * n : (peer + 1) * n]
    results = {}
    for way in ("gloo", "shared memory"):
        theirs.zero_()
        dist.barrier()
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        for i in range(reps):
            if way == "gloo":
                received = dist.irecv(theirs, peer)
                sent = dist.isend(mine, peer)
                received.wait()
                sent.wait()
            else:
                slot = slots[i % 2]
                slot[rank].copy_(mine)
                pipes[rank].send_bytes(b"w")  # my slot is written
                pipes[rank].recv_bytes()  # and the peer's
                theirs.copy_(slot[peer])
            gathered[rank * n : (rank + 1) * n].copy_(mine)
        results[way] = (
            (time.perf_counter() - t0) / reps,
            (time.thread_time() - c0) / reps,
            (time.process_time() - p0) / reps,
        )
        assert bool((theirs == peer + 1).all()), f"rank {rank}: {way} delivered the wrong values"
    out.put((rank, results))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kilobytes", type=float, default=100.0)
    p.add_argument("--reps", type=int, default=2000)
    args = p.parse_args()
    n = int(args.kilobytes * 1000) // 4
    slots = [torch.zeros(2, n).share_memory_() for _ in range(2)]
    a, b = mp.Pipe()
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(_rank, args=(slots, [a, b], _free_port(), n, args.reps, out), nprocs=2)
    got = dict(out.get() for _ in range(2))
    print(f"# one pairwise exchange of {4 * n / 1000:.0f} KB, CPU, W=2, {args.reps} exchanges, per rank")
    print(f"{'way':14} {'rank':>4} {'us an exchange':>15} {'main thread CPU us':>19} {'process CPU us':>15}")
    for way in ("gloo", "shared memory"):
        for rank in (0, 1):
            wall, thread, process = (1e6 * x for x in got[rank][way])
            print(f"{way:14} {rank:>4} {wall:>15.0f} {thread:>19.0f} {process:>15.0f}")


if __name__ == "__main__":
    main()
