"""The whole step as one graph, the way SimpleFSDP does it, next to fsdp_fn's step.

A SimpleFSDP-style step: every parameter lives as a flat shard; the forward all-gathers each
one with torch's functional collective (``all_gather_tensor_autograd``, whose backward is the
reduce-scatter), inside ``torch.func.functional_call`` of the plain model, and the whole loss
(all its gathers included) is compiled with ``fullgraph=True``; AdamW steps the shards.
Rows, each on the same tiny GPT, batches and initial weights, in one pool of ranks:

* ``simple_fsdp eager`` and ``simple_fsdp compiled`` (``--backend``, inductor by default):
  the same step, without and with ``torch.compile`` of the loss and its gathers;
* ``fsdp_fn`` and ``fsdp_fn compiled``: fsdp_fn's train step, eager and with its blocks
  compiled (``train_step(compile=...)``).

Reported: the median step (max over ranks), Dynamo's graphs and graph breaks, and the losses of
every row against fsdp_fn's.

    python bench/whole_step.py                       # W=2, CPU, gloo, 4 blocks, d 128
    python bench/whole_step.py --backend aot_eager --layers 2
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from fsdp_fn.testing import RankPool


def _config(args: Any) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=2)


def _batches(args: Any, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(args.steps)]


def _simple_fsdp(group: Any, args: Any, compiled: bool) -> tuple[list[float], list[float], dict[str, int]]:
    from torch._dynamo.utils import counters
    from torch.distributed._functional_collectives import all_gather_tensor_autograd

    torch._dynamo.reset()
    counters.clear()
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = GPT(_config(args))
    shapes = {k: p.shape for k, p in model.named_parameters()}
    shards = {}
    for k, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        n = -(-flat.numel() // world)
        padded = torch.cat([flat, flat.new_zeros(n * world - flat.numel())])
        shards[k] = padded[rank * n : (rank + 1) * n].clone().requires_grad_()
    opt = torch.optim.AdamW(list(shards.values()), lr=1e-3, foreach=True)

    def loss_of(shards: dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
        full = {}
        for k, s in shards.items():
            gathered = all_gather_tensor_autograd(s, gather_dim=0, group=group)
            full[k] = gathered[: shapes[k].numel()].view(shapes[k])
        # The reduce-scatter sums the ranks' gradients: divide the loss, and the gradient is the mean.
        return lm_loss(lambda x: torch.func.functional_call(model, full, (x,)), batch) / world

    run = torch.compile(loss_of, backend=args.backend, fullgraph=True) if compiled else loss_of
    losses, times = [], []
    for batch in _batches(args, rank):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = run(shards, batch)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        losses.append(float(mean))
    stats = {"graphs": int(counters["stats"]["unique_graphs"]), "breaks": sum(counters["graph_break"].values())}
    return losses, times, stats


def _fsdp_fn(group: Any, args: Any, compiled: bool) -> tuple[list[float], list[float], dict[str, int]]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(_config(args))
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]))
    options = {"backend": args.backend} if compiled else False
    step = ff.train_step(fn, lm_loss, ff.adamw(lr=1e-3), compile=options)
    state = step.init(ff.shard(fn.params, plan, group))
    losses, times = [], []
    for batch in _batches(args, group.rank()):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        times.append(time.perf_counter() - t0)
        losses.append(float(metrics["loss"]))
    stats = {"graphs": int(counters["stats"]["unique_graphs"]), "breaks": sum(counters["graph_break"].values())}
    return losses, times, stats


ROWS = {
    "simple_fsdp eager": (_simple_fsdp, False),
    "simple_fsdp compiled": (_simple_fsdp, True),
    "fsdp_fn": (_fsdp_fn, False),
    "fsdp_fn compiled": (_fsdp_fn, True),
}


def _row(group: Any, name: str, args: Any) -> tuple[list[float], list[float], dict[str, int]]:
    fn, compiled = ROWS[name]
    return fn(group, args, compiled)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the median (compilation)")
    p.add_argument("--backend", default="inductor")
    args = p.parse_args()
    with RankPool(args.world, warnings_as_errors=False) as pool:
        results = {name: pool.run(_row, name, args) for name in ROWS}
    reference = results["fsdp_fn"][0][0]
    print(f"# whole step vs per unit, CPU, gloo, W={args.world}, GPT d {args.d_model} x {args.layers} blocks")
    print(f"{'row':22} {'step ms':>8} {'graphs':>7} {'breaks':>7} {'max |loss - fsdp_fn|':>22}")
    for name, ranks in results.items():
        losses, _, stats = ranks[0]
        step = max(statistics.median(r[1][args.warmup :]) for r in ranks)
        diff = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
        print(f"{name:22} {1e3 * step:8.1f} {stats['graphs']:7d} {stats['breaks']:7d} {diff:22.2e}")


if __name__ == "__main__":
    main()
