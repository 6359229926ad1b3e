"""What marking a unit's backward costs, alone, in one process: a hook on its outputs'
gradients (``register_multi_grad_hook(mode="any")``, what fsdp_fn uses to refill a unit)
against an identity ``autograd.Function`` on them (what it used before).

Each way runs ``y = a * 2`` on 4 elements, marks ``y``, then ``y.sum().backward()``, many
times; reported: microseconds per iteration beyond the unmarked loop.

    python bench/refill_overhead.py --iterations 20000
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _unmarked(y: torch.Tensor) -> torch.Tensor:
    return y


def _function(y: torch.Tensor) -> torch.Tensor:
    return _Identity.apply(y)


def _hook(y: torch.Tensor) -> torch.Tensor:
    register_multi_grad_hook([y], lambda grad: None, mode="any")
    return y


def per_iteration(mark: Callable[[torch.Tensor], torch.Tensor], iterations: int) -> float:
    """Microseconds per forward-mark-backward iteration."""
    a = torch.ones(4, requires_grad=True)
    start = time.perf_counter()
    for _ in range(iterations):
        mark(a * 2).sum().backward()
    return (time.perf_counter() - start) / iterations * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=20000)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    ways = {"unmarked": _unmarked, "identity Function": _function, "gradient hook": _hook}
    best = {name: min(per_iteration(mark, args.iterations) for _ in range(args.reps)) for name, mark in ways.items()}
    for name, us in best.items():
        print(f"[CPU] {name:>18}: {us:6.1f} µs per iteration, {us - best['unmarked']:+5.1f} µs for the mark")


if __name__ == "__main__":
    main()
