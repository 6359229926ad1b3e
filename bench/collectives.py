"""How fast each way of all-gathering and reduce-scattering is on this backend (gloo on CPU).

    python bench/collectives.py                 # W = 2 and 4, a 16 MB buffer
    python bench/collectives.py --worlds 2 --megabytes 0.2 --reps 200   # a tiny GPT block's size: latency

The figures choose fsdp_fn's gloo algorithm (``fsdp_fn/_comm.py``: ``PairwiseComm``).
Each rank sends (W-1)/W of the buffer in every variant except all_reduce (2x).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from fsdp_fn.testing import RankPool


def measure(group: Any, megabytes: float, reps: int) -> dict[str, float]:
    world, rank = group.size(), group.rank()
    n = int(megabytes * 2**20) // 4 // world * world
    full, shard = torch.randn(n), torch.randn(n // world)
    out, received = torch.empty(n // world), torch.empty(n)

    def timed(f: Any) -> float:
        f()
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(reps):
            f()
        dist.barrier(group=group)
        return (time.perf_counter() - start) / reps * 1e3

    def pairwise_all_gather() -> None:
        ops = []
        for j in range(world):
            if j != rank:
                ops.append(dist.P2POp(dist.isend, shard, group=group, group_peer=j))
                ops.append(
                    dist.P2POp(dist.irecv, full[j * len(shard) : (j + 1) * len(shard)], group=group, group_peer=j)
                )
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    scratch = torch.empty(world - 1, n // world)

    def pairwise_reduce_scatter() -> None:
        ops, k = [], 0
        for j in range(world):
            if j != rank:
                ops.append(dist.P2POp(dist.isend, full[j * len(out) : (j + 1) * len(out)], group=group, group_peer=j))
                ops.append(dist.P2POp(dist.irecv, scratch[k], group=group, group_peer=j))
                k += 1
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        out.copy_(full[rank * len(out) : (rank + 1) * len(out)]).add_(scratch.sum(0))

    return {
        "all_gather (gloo)": timed(lambda: dist.all_gather_single(full, shard, group=group)),
        "all_gather as isend/irecv (fsdp_fn)": timed(pairwise_all_gather),
        "all_gather as all_to_all (W-fold send copy)": timed(
            lambda: dist.all_to_all_single(full, shard.repeat(world), group=group)
        ),
        "reduce_scatter (gloo)": timed(lambda: dist.reduce_scatter_single(out, full, group=group)),
        "reduce_scatter as isend/irecv + sum (fsdp_fn)": timed(pairwise_reduce_scatter),
        "reduce_scatter as all_to_all + sum": timed(
            lambda: dist.all_to_all_single(received, full, group=group) or received.view(world, -1).sum(0)
        ),
        "all_reduce (gloo)": timed(lambda: dist.all_reduce(full, group=group)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--megabytes", type=float, default=16)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    for world in map(int, args.worlds.split(",")):
        with RankPool(world, warnings_as_errors=False) as pool:
            result = pool.run(measure, args.megabytes, args.reps)[0]
        print(f"W={world}, {args.megabytes} MB buffer, ms per call:")
        for name, ms in result.items():
            print(f"  {name:<46} {ms:8.3f}")


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
