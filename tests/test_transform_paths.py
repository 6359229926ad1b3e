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


def _aux_under_jvp(group):
    """value_and_grad(has_aux=True) inside jvp: the aux carries its forward-mode tangent, as
    torch.func.grad's aux does, and the gradient's tangent is the Hessian-vector product."""
    model = _model()
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([nn.Linear]))
    params = ff.shard(fn.params, plan, group)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(group.rank()))
    full_v = {k: torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) for k, p in fn.params.items()}
    v = ff.shard(full_v, plan, group).shards

    def with_aux(m, batch):
        out = m(batch)
        return _loss(lambda _: out, batch), {"mean": out.mean(), "step": 3}

    def sharded(s):
        (loss, aux), grads = ff.value_and_grad(fn, with_aux, has_aux=True)(params.replace(s), fn.buffers, x)
        return aux["mean"], grads.shards

    (aux, _), (aux_tangent, grad_tangent) = torch.func.jvp(sharded, (params.shards,), (v,))

    # The reference: one process, the whole model, this rank's batch, plain torch.func.
    def reference(p):
        out = torch.func.functional_call(model, p, (x,))
        return _loss(lambda _: out, x), out.mean()

    want_aux, want_tangent = torch.func.jvp(
        lambda p: torch.func.grad(reference, has_aux=True)(p)[1], (dict(fn.params),), (full_v,)
    )
    # With plain autograd outside, the same aux comes back detached: nothing to differentiate.
    (_, plain_aux), _ = ff.value_and_grad(fn, with_aux, has_aux=True)(params, fn.buffers, x)
    return (
        (aux - want_aux).abs().item(),
        (aux_tangent - want_tangent).abs().item(),
        abs(want_tangent.item()),
        max(t.abs().max().item() for t in grad_tangent.values()),
        plain_aux["step"],
        plain_aux["mean"].requires_grad,
    )


def test_aux_under_an_outer_jvp_carries_its_tangent(pool):
    for aux_err, tangent_err, size, hvp, step, requires_grad in pool.run(_aux_under_jvp, world=2):
        assert aux_err < 1e-6
        assert size > 1e-3
        assert tangent_err < 1e-5 * max(1.0, size)
        assert hvp > 0
        assert step == 3 and not requires_grad


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.register_buffer("scale", torch.linspace(1.0, 2.0, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


def _buffers_of_the_transform(group):
    """Buffers made inside the transformed function (a fresh copy per call) or differentiated
    by it are of its level already: used as they are (before: functorch's internal assert),
    with torch.func.functional_call's results on the full parameters."""
    torch.manual_seed(0)
    model = _Scaled()
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))  # the same data on every rank
    full = dict(fn.params)

    def sharded(s, b):
        return ff.apply_sharded(fn, params.replace(s), b, x).square().sum()

    def plain(p, b):
        return torch.func.functional_call(model, {**p, **b}, (x,)).square().sum()

    def fresh(b):
        return {k: v.clone() for k, v in b.items()}

    out = {}
    got = torch.func.grad(lambda s: sharded(s, fresh(fn.buffers)))(params.shards)
    want = torch.func.grad(lambda p: plain(p, fresh(fn.buffers)))(full)
    out["cloned inside"] = (ff.unshard(params.replace(got)), want)
    gs, gb = torch.func.grad(sharded, argnums=(0, 1))(params.shards, dict(fn.buffers))
    ws, wb = torch.func.grad(plain, argnums=(0, 1))(full, dict(fn.buffers))
    out["buffers differentiated"] = ({**ff.unshard(params.replace(gs)), **gb}, {**ws, **wb})
    v = {u: torch.ones_like(t) for u, t in params.shards.items()}
    _, tangent = torch.func.jvp(lambda s: sharded(s, fresh(fn.buffers)), (params.shards,), (v,))
    full_v = ff.unshard(params.replace(v))
    _, want_tangent = torch.func.jvp(lambda p: plain(p, fresh(fn.buffers)), (full,), (full_v,))
    out["jvp"] = ({"t": tangent}, {"t": want_tangent})
    return {k: max((a[n] - b[n]).abs().max().item() for n in b) for k, (a, b) in out.items()}


def test_buffers_of_the_transforms_own_level(pool):
    for worst in pool.run(_buffers_of_the_transform, world=2):
        assert all(w < 1e-5 for w in worst.values()), worst
