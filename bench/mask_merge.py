"""What ``update_in_backward``'s merge of each unit's reached-parameter mask costs the step:
the time the step thread spends issuing its messages and waiting for them (at the update,
or at the end of backward when this rank reached every parameter), per step, on the bench GPT
(d_model 512, 8 blocks, vocab 8192; 2x128 tokens per rank; ``split_root``, AdamW).

Reported per rank: the median over the timed steps of the milliseconds spent in the merge,
and the median step time (CPU, gloo; one torch thread per rank).

    python bench/mask_merge.py --world 2 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import fsdp_fn as ff
import fsdp_fn._sink as sink
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from fsdp_fn.testing import RankPool


def _run(group: dist.ProcessGroup, steps: int, warmup: int) -> tuple[float, float]:
    spent: list[float] = []
    start = sink.all_reduce_start  # the merge's messages: issued, and waited for wherever that happens

    def timed(*args: Any) -> Callable[[], torch.Tensor]:
        t = time.perf_counter()
        finish = start(*args)
        spent.append(time.perf_counter() - t)

        def result() -> torch.Tensor:
            t = time.perf_counter()
            out = finish()
            spent.append(time.perf_counter() - t)
            return out

        return result

    sink.all_reduce_start = timed  # type: ignore[assignment]
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab=8192, seq=128, d_model=512, n_layers=8, n_heads=8)
    torch.manual_seed(0)
    model = GPT(cfg)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]), split_root=True)
    step = ff.train_step(fn, lm_loss, ff.adamw(), schedule=ff.Schedule(update_in_backward=True))
    state = step.init(ff.shard(fn.params, plan, group))
    tokens = torch.Generator().manual_seed(group.rank())
    in_merge, step_s = [], []
    for k in range(warmup + steps):
        batch = torch.randint(0, cfg.vocab, (2, cfg.seq + 1), generator=tokens)
        before, t = len(spent), time.perf_counter()
        state, _ = step(state, batch)
        if k >= warmup:
            step_s.append(time.perf_counter() - t)
            in_merge.append(sum(spent[before:]))
    return statistics.median(in_merge) * 1e3, statistics.median(step_s) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    with RankPool(args.world) as pool:
        for rank, (merge_ms, step_ms) in enumerate(pool.run(_run, args.steps, args.warmup, world=args.world)):
            print(f"rank {rank} [CPU, gloo, W={args.world}]: mask merge {merge_ms:.1f} ms of a {step_ms:.0f} ms step")


if __name__ == "__main__":
    main()
