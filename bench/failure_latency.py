"""How long the other ranks take to raise after one rank's exception (docs/errors.md).

Rank 1 raises in the forward pre-hook of ``blocks.2`` of the tests' tiny GPT (W=3); ranks
0 and 2 are then waiting on a collective and learn of it from the store, which the step's
guard reads every 50 ms. Prints, per repetition, the time from the raise to the last other
rank's ``RankFailure`` (same host, same clock).

    python bench/failure_latency.py --reps 5     # CPU, gloo
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

import fsdp_fn as ff
from examples.gpt import GPT, Block, lm_loss
from fsdp_fn.testing import RankError, RankPool
from tests.helpers import local_part
from tests.test_reliability import CFG


def _one_rank_raises(group):
    rank, world = group.rank(), group.size()
    torch.manual_seed(0)
    model = GPT(CFG)
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([Block])), group)
    step = ff.train_step(fn, lm_loss, ff.adamw(lr=1e-2))
    state = step.init(params)
    raised = []

    def hook(module, args):
        if rank == 1 and module is model.blocks[2]:
            raised.append(time.time())
            raise ValueError("bad input")

    handles = [b.register_forward_pre_hook(hook) for b in model.blocks]
    tokens = torch.randint(0, CFG.vocab, (2 * world, CFG.seq + 1), generator=torch.Generator().manual_seed(0))
    try:
        step(state, local_part(tokens, rank, world))
    except Exception as e:
        return (raised[0] if raised else time.time(), type(e).__name__)
    finally:
        for h in handles:
            h.remove()
    return (None, "no error")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    latencies = []
    for _ in range(args.reps):
        with RankPool(3, timeout=120) as pool:
            try:
                results = pool.run(_one_rank_raises, world=3)
            except RankError as e:
                results = [v for _, v in sorted(e.results.items())]
        (t0, k0), (t1, k1), (t2, k2) = results
        assert (k0, k1, k2) == ("RankFailure", "ValueError", "RankFailure"), results
        latencies.append(max(t0, t2) - t1)
        print(f"other ranks raised {1e3 * latencies[-1]:.1f} ms after rank 1", flush=True)
    print(f"range over {args.reps} runs: {1e3 * min(latencies):.0f}-{1e3 * max(latencies):.0f} ms")


if __name__ == "__main__":
    main()
