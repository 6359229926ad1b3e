"""Every way of differentiating through the sharded function sees the mean over all ranks,
replicas included, or gets a clear error: never a silent zero."""

from __future__ import annotations

import torch
from torch import nn

import fsdp_fn as ff


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _loss(model, batch):
    return (model(batch) ** 3).mean()  # written by hand: jvp of grad through F.mse_loss hits a torch limit


def _hybrid_paths(group):
    """A 2 x 2 mesh: grad through apply_sharded and gather_for, and value_and_grad inside jvp,
    equal the plain (lean) value_and_grad, which averages over shards and replicas."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = group.rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model()
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), mesh)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))  # different data on every rank
    _, lean = ff.value_and_grad(fn, _loss)(params, fn.buffers, x)
    through_apply = torch.func.grad(lambda s: _loss(lambda b: ff.apply_sharded(fn, params.replace(s), {}, b), x))(
        params.shards
    )
    v = {u: torch.ones_like(t) for u, t in params.shards.items()}
    _, tangent = torch.func.jvp(
        lambda s: ff.value_and_grad(fn, _loss)(params.replace(s), fn.buffers, x)[1].shards, (params.shards,), (v,)
    )
    return (
        max((lean[u] - through_apply[u]).abs().max().item() for u in lean),
        max(t.abs().max().item() for t in tangent.values()),
    )


def test_hybrid_replicas_average_on_every_path(pool):
    for worst, hvp in pool.run(_hybrid_paths, world=4):
        assert worst < 1e-6
        assert hvp > 0  # a Hessian-vector product through the replicas, not a silent zero


def _outside(group):
    """value_and_grad under plain autograd (double backward) equals the same product in torch.func;
    a train step inside a transform raises instead of returning zeros."""
    model = _model()
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(group.rank()))
    v = {u: torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) for u, t in params.shards.items()}
    leaves = {u: t.detach().clone().requires_grad_() for u, t in params.shards.items()}
    _, g = ff.value_and_grad(fn, _loss)(params.replace(leaves), fn.buffers, x)
    by_autograd = torch.autograd.grad(sum((g[u] * v[u]).sum() for u in g), list(leaves.values()))
    _, by_func = torch.func.jvp(
        lambda s: ff.value_and_grad(fn, _loss)(params.replace(s), fn.buffers, x)[1].shards, (params.shards,), (v,)
    )
    step = ff.train_step(fn, _loss, ff.sgd())
    state = step.init(params)
    try:
        torch.func.grad(lambda s: step(state._replace(params=params.replace(s)), x)[1]["loss"])(params.shards)
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    # Backward through the gathers is the mean over ranks of each rank's scalar g_r . v_r, that
    # is (g . v) / W: autograd's Hessian-vector product is the forward-mode one over W.
    world = group.size()
    worst = max((a * world - by_func[u]).abs().max().item() for a, u in zip(by_autograd, leaves))
    return worst, max(t.abs().max().item() for t in by_func.values()), message


def test_outer_derivatives_see_through_or_are_refused(pool):
    for worst, size, message in pool.run(_outside, world=2):
        assert size > 0
        assert worst < 1e-5
        assert "a train step cannot run inside a torch.func transform" in message
        assert "differentiate fsdp_fn.value_and_grad" in message
