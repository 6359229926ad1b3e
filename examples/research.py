"""Research on sharded parameters with torch.func: per-example gradients, curvature, forward mode.

Each function runs on every rank of ``group`` (SPMD) and returns what it computed; the
tests (``tests/test_transforms.py``) run them on 1-4 gloo ranks against the unsharded
model. Run them yourself on two CPU ranks::

    torchrun --standalone --nproc-per-node 2 -m examples.research

The convention behind every line (docs/concepts.md): the gradient of a gathered unit is
reduce-scattered as a mean over ranks, so the gradient of a loss computed by every rank
on its part of the batch is the gradient of the global batch's mean loss; a tangent is
sharded like the parameters.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdp_fn as ff

Shards = dict[str, torch.Tensor]


def make_model(seed: int = 0, widths: tuple[int, ...] = (5, 11, 7, 3)) -> nn.Module:
    """A small float64 MLP (every rank builds the same one)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()


def setup(group: Any, seed: int = 0) -> tuple[ff.Functional, ff.Sharded]:
    """The model as a pure function and its parameters sharded over ``group``, a unit per layer."""
    module = make_model(seed)
    fn = ff.functionalize(module)
    return fn, ff.shard(fn.params, ff.make_plan(module, ff.layer_policy([nn.Linear])), group)


def model_on(fn: ff.Functional, params: ff.Sharded) -> Callable[[Shards], Callable[..., torch.Tensor]]:
    """``model_on(fn, params)(shards)(x)``: the module run on ``shards`` by ``apply_sharded``
    (each unit all-gathered as it runs; every torch.func transform composes with it)."""

    def with_shards(shards: Shards) -> Callable[..., torch.Tensor]:
        return functools.partial(ff.apply_sharded, fn, params.replace(shards), fn.buffers)

    return with_shards


def squared_error(model: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().mean()


def global_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum over ranks of ``x`` (any shape): one all-gather."""
    world = group.size()
    return ff.all_gather(x.reshape(-1), group).view(world, *x.shape).sum(0)


def data(world: int, per_rank: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (the same on every rank); rank ``r`` owns rows ``r*per_rank..``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * per_rank, 5, generator=g, dtype=torch.float64)
    return x, torch.randn(world * per_rank, 3, generator=g, dtype=torch.float64)


# --- per-example gradients: DP-SGD-style clipping -------------------------------------------


def dp_sgd_gradient(group: Any, clip: float = 2.0, noise: float = 0.0, per_rank: int = 3) -> dict[str, Any]:
    """Per-example gradient norms over the global batch, each example clipped to ``clip``, summed,
    noised and averaged, with parameters that stay sharded.

    The reduce-scatter sums slot ``i`` of the vmapped batch over ranks, so each rank puts its
    own examples in its own slots (the others hold a zero-weight example): slot ``i`` then
    carries exactly example ``i``'s gradient, and every rank holds its shard of every
    example's gradient. A norm needs every shard: one all-gather of the per-example squared
    norms. Memory: ``batch x`` one shard per unit of per-example gradients; communication
    per unit: one all-gather and one reduce-scatter, each over the whole batch at once.
    """
    world, rank = group.size(), group.rank()
    fn, params = setup(group)
    model = model_on(fn, params)
    x, y = data(world, per_rank)
    mine = torch.zeros(world * per_rank, dtype=torch.float64)
    mine[rank * per_rank : (rank + 1) * per_rank] = world  # x W: gradients average over ranks
    x_here, y_here = x * (mine[:, None] != 0), y * (mine[:, None] != 0)  # only my examples leave this rank

    def one(shards: Shards, xi: torch.Tensor, yi: torch.Tensor, wi: torch.Tensor) -> torch.Tensor:
        return wi * squared_error(model(shards), xi[None], yi[None])

    per_example = torch.vmap(torch.func.grad(one), in_dims=(None, 0, 0, 0))(params.shards, x_here, y_here, mine)
    square = sum(g.square().sum(1) for g in per_example.values())  # (batch,) this rank's part
    norms = global_sum(square, group).sqrt()
    factor = (clip / norms).clamp(max=1.0)
    grad = {u: (factor[:, None] * g).sum(0) for u, g in per_example.items()}
    if noise:  # independent noise per shard is independent noise on the whole vector
        gen = torch.Generator().manual_seed(1234 + rank)
        grad = {u: g + noise * clip * torch.randn(g.shape, generator=gen, dtype=g.dtype) for u, g in grad.items()}
    return {"norms": norms, "grad": {u: g / len(x) for u, g in grad.items()}}


# --- curvature: Hessian-vector products and the top eigenvalue ------------------------------


def hessian_vector_product(
    group: Any, vector: Shards | None = None, per_rank: int = 3
) -> tuple[ff.Sharded, Shards, Callable[[Shards], Shards]]:
    """``(params, v, hvp)``: ``hvp(v)`` is this rank's shard of ``H v``, ``H`` the Hessian of the
    global batch's mean loss, as forward-over-reverse (``jvp`` of ``grad``).

    Memory: one gradient and one tangent of the shards; communication: twice a gradient's
    (the jvp carries a tangent through every all-gather and reduce-scatter).
    """
    world, rank = group.size(), group.rank()
    fn, params = setup(group)
    model = model_on(fn, params)
    x, y = data(world, per_rank)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]

    def grad(shards: Shards) -> Shards:
        return torch.func.grad(lambda s: squared_error(model(s), x, y))(shards)  # type: ignore[no-any-return]

    def hvp(v: Shards) -> Shards:
        return torch.func.jvp(grad, (params.shards,), (v,))[1]  # type: ignore[no-any-return]

    if vector is None:  # a random direction, sharded like the parameters (zero in the padding)
        g = torch.Generator().manual_seed(7)
        vector = ff.shard(
            {k: torch.randn(p.shape, generator=g, dtype=p.dtype) for k, p in fn.params.items()}, params.plan, group
        ).shards
    return params, vector, hvp


def top_hessian_eigenvalue(group: Any, iterations: int = 50) -> dict[str, Any]:
    """The largest-magnitude eigenvalue of the loss Hessian by power iteration on sharded vectors.

    Each iteration: one Hessian-vector product and one all-gather of two numbers (the
    global norm and the Rayleigh quotient need every rank's part).
    """
    _, v, hvp = hessian_vector_product(group)
    eigenvalue = torch.zeros((), dtype=torch.float64)
    history = []
    for _ in range(iterations):
        norm = global_sum(sum(t.square().sum() for t in v.values()), group).sqrt()
        v = {u: t / norm for u, t in v.items()}
        hv = hvp(v)
        eigenvalue = global_sum(sum((a * b).sum() for a, b in zip(v.values(), hv.values(), strict=True)), group)
        history.append(float(eigenvalue))
        v = hv
    return {"eigenvalue": float(eigenvalue), "history": history}


# --- forward mode: a directional derivative ------------------------------------------------


def directional_derivative(group: Any, per_rank: int = 3) -> dict[str, float]:
    """``d/de loss(params + e v)`` at ``e = 0`` in one forward pass (``jvp``), for the global mean loss,
    and the same number from the gradient, ``<grad, v>`` (summed over ranks).

    Memory: a tangent per activation, no backward; communication: each unit's all-gather
    carries the tangent's all-gather with it.
    """
    world, rank = group.size(), group.rank()
    params, v, _ = hessian_vector_product(group, per_rank=per_rank)
    fn = ff.functionalize(make_model())
    model = model_on(fn, params)
    x, y = data(world, per_rank)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]

    def loss(shards: Shards) -> torch.Tensor:
        return squared_error(model(shards), x, y)

    value, slope = torch.func.jvp(loss, (params.shards,), (v,))
    grad = torch.func.grad(loss)(params.shards)
    dot = global_sum(sum((grad[u] * v[u]).sum() for u in v), group)
    return {
        "loss": float(global_sum(value, group)) / world,
        "jvp": float(global_sum(slope, group)) / world,
        "dot": float(dot),
    }


if __name__ == "__main__":
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    clipped = dp_sgd_gradient(group)
    top = top_hessian_eigenvalue(group)
    slope = directional_derivative(group)
    if dist.get_rank() == 0:
        print("per-example gradient norms:", [round(float(n), 4) for n in clipped["norms"]])
        print(f"top Hessian eigenvalue: {top['eigenvalue']:.6f}")
        print(f"directional derivative: jvp {slope['jvp']:.8f}, <grad, v> {slope['dot']:.8f}")
    dist.destroy_process_group()
