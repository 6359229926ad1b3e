"""Every torch.func transform through sharded parameters equals the unsharded result.

The convention (the SPMD program's own derivative, as in JAX's shard_map): every rank
runs the same code on its shard; a tangent, cotangent or basis vector given on a rank is
that rank's part of the global one; gradients average over ranks (``gather_for``'s
reduce-scatter is a mean). So, with ``R`` the reference's derivative with respect to the
full flat (padded) unit buffers and ``[r]`` this rank's slice of them:

- ``grad``/``vjp`` of the rank's loss on its part of the batch: ``grad(mean loss)[r]``;
- ``jvp`` with tangent slices: the rank's part of the reference's output tangent;
- ``vmap`` of ``grad`` over the same global batch on every rank: per-example ``[r]``;
- ``jacrev`` (replicated input): the reference Jacobian's columns ``[r]``;
- ``jacfwd``: the same basis vector moves slot ``j`` on every rank, so the reference
  Jacobian summed over the rank slots ("folded");
- Hessian-vector products: ``jvp`` of ``grad`` gives ``(H v)[r]``; ``grad`` of the
  rank's partial dot ``<grad[r], v[r]>`` gives ``(H v)[r] / W`` (the dot is one rank's
  share of a sum, and gradients average);
- ``hessian`` (replicated input): rows ``[r]``, columns folded; ``jacrev`` of ``grad``
  (reverse over reverse): columns ``[r]``, rows folded, divided by ``W``;
- ``grad`` of an outer loss after inner ``grad`` steps (MAML): the meta-gradient of the mean
  outer loss, ``[r]``: exact at every ``W``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdp_fn as ff
from fsdp_fn import testing as fft
from fsdp_fn._shard import unit_views

TOL = {"rtol": 1e-7, "atol": 1e-9}


def _slice(t, world, rank):
    """This rank's slots of a tensor whose last dim is a full (padded) flat buffer."""
    return t.unflatten(-1, (world, -1)).select(-2, rank)


def _fold(t, world):
    return t.unflatten(-1, (world, -1)).sum(-2)


# --- the pair itself -------------------------------------------------------------------


def _pair(group, examples):
    world, rank = group.size(), group.rank()

    @settings(max_examples=examples)
    @given(n=st.integers(1, 5), batch=st.integers(1, 3), dim=st.integers(0, 1), seed=st.integers(0, 2**16))
    def prop(n, batch, dim, seed):
        g = torch.Generator().manual_seed(seed * 31 + rank)  # different data on every rank
        x, t = (torch.randn(n, generator=g, dtype=torch.float64) for _ in range(2))
        y, u = (torch.randn(world * n, generator=g, dtype=torch.float64) for _ in range(2))
        ag = functools.partial(ff.all_gather, group=group)
        rs = functools.partial(ff.reduce_scatter_sum, group=group, scale=0.5)
        # jvp: the tangent of AG is AG of the tangent; of scale * RS, scale * RS of the tangent.
        out, tangent = torch.func.jvp(ag, (x,), (t,))
        torch.testing.assert_close(out, ag(x))
        torch.testing.assert_close(tangent, ag(t))
        out, tangent = torch.func.jvp(rs, (y,), (u,))
        torch.testing.assert_close(out, rs(y))
        torch.testing.assert_close(tangent, rs(u))
        # vmap over dim 0 or 1: one collective for the batch, each element gathered/scattered alone.
        xs = torch.randn(batch, n, generator=g, dtype=torch.float64)
        ys = torch.randn(batch, world * n, generator=g, dtype=torch.float64)
        with ff.comm_log() as log:
            got = torch.vmap(ag, in_dims=dim)(xs.T.contiguous() if dim else xs)
        # (and before it one exchange of the batch's size: every rank's must be the same)
        assert [r.op for r in log.records] == (["batch_size", "all_gather"] if world > 1 else [])
        torch.testing.assert_close(got, torch.stack([ag(e) for e in xs]))
        got = torch.vmap(rs, in_dims=dim)(ys.T.contiguous() if dim else ys)
        torch.testing.assert_close(got, torch.stack([rs(e) for e in ys]))
        # in_dims None: the collective's input is not batched, something else is.
        scales = torch.randn(batch, generator=g, dtype=torch.float64)
        got = torch.vmap(lambda c: ag(x) * c)(scales)
        torch.testing.assert_close(got, scales[:, None] * ag(x))
        got = torch.vmap(lambda c: rs(y) * c)(scales)
        torch.testing.assert_close(got, scales[:, None] * rs(y))
        # vmap of jvp and jvp of vmap
        ts = torch.randn(batch, n, generator=g, dtype=torch.float64)
        got = torch.vmap(lambda tt: torch.func.jvp(ag, (x,), (tt,))[1])(ts)
        torch.testing.assert_close(got, torch.stack([ag(e) for e in ts]))

    prop()
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_pair_jvp_and_vmap_rules(pool, world):
    assert all(pool.run(_pair, 6, world=world))


def _nested_pair(group):
    """Nested transforms of f(s) = sum(sin(AG(s)) * c): every one against the full-vector reference."""
    world, rank = group.size(), group.rank()
    n = 3
    g = torch.Generator().manual_seed(7)  # the same on every rank: a replicated function
    full, c, v = (torch.randn(world * n, generator=g, dtype=torch.float64) for _ in range(3))
    x, vr = _slice(full, world, rank).clone(), _slice(v, world, rank).clone()

    def f(s):
        return (ff.all_gather(s, group, grad_scale=1.0 / world).sin() * c).sum()

    def ref(z):
        return (z.sin() * c).sum()

    grad, hess = torch.func.grad(ref)(full), torch.func.hessian(ref)(full)
    torch.testing.assert_close(torch.func.grad(f)(x), _slice(grad, world, rank), **TOL)
    hv = hess @ v
    torch.testing.assert_close(torch.func.jvp(torch.func.grad(f), (x,), (vr,))[1], _slice(hv, world, rank), **TOL)
    got = torch.func.grad(lambda s: torch.dot(torch.func.grad(f)(s), vr))(x)
    torch.testing.assert_close(got, _slice(hv, world, rank) / world, **TOL)
    torch.testing.assert_close(torch.func.hessian(f)(x), _fold(_slice(hess.T, world, rank).T, world), **TOL)
    vec = lambda s: ff.all_gather(s, group, grad_scale=1.0 / world).sin() * c  # noqa: E731
    jac = torch.func.jacrev(lambda z: z.sin() * c)(full)
    torch.testing.assert_close(torch.func.jacrev(vec)(x), _slice(jac, world, rank), **TOL)
    torch.testing.assert_close(torch.func.jacfwd(vec)(x), _fold(jac, world), **TOL)
    # vmap of grad: per-example gradients of sum(sin(AG(s)) * c_i)
    cs = torch.randn(4, world * n, generator=g, dtype=torch.float64)
    got = torch.vmap(torch.func.grad(lambda s, ci: (ff.all_gather(s, group).sin() * ci).sum()), in_dims=(None, 0))(
        x, cs
    )
    want = torch.vmap(torch.func.grad(lambda z, ci: (z.sin() * ci).sum()), in_dims=(None, 0))(full, cs)
    torch.testing.assert_close(got, world * _slice(want, world, rank), **TOL)  # a sum over W identical ranks
    # MAML: the outer loss after two inner steps; an exact meta-gradient, where the inner
    # gradients' average must not be taken a second time by the outer derivative
    got = torch.func.grad(lambda s: f(s - 0.3 * torch.func.grad(f)(s - 0.3 * torch.func.grad(f)(s))))(x)
    want = torch.func.grad(lambda z: ref(z - 0.3 * torch.func.grad(ref)(z - 0.3 * torch.func.grad(ref)(z))))(full)
    torch.testing.assert_close(got, _slice(want, world, rank), **TOL)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_nested_transforms_of_the_pair(pool, world):
    assert all(pool.run(_nested_pair, world=world))


def _hybrid_pair(group):
    """Hybrid sharding by hand: 2 replicas x 2 shards. ``replicate`` ties the replicas' copies of
    a shard; every transform equals the reference on the mean over all 4 ranks' losses."""
    from fsdp_fn._collectives import all_reduce_sum, replicate

    mesh = fft.LayoutSpec(4, 2).group()
    shards, replicas = mesh.get_group(1), mesh.get_group(0)
    world, rank = shards.size(), shards.rank()
    n = 3
    g = torch.Generator().manual_seed(11)
    full, v = (torch.randn(world * n, generator=g, dtype=torch.float64) for _ in range(2))
    cs = torch.randn(4, world * n, generator=g, dtype=torch.float64)  # each rank's own data
    c = cs[torch.distributed.get_rank()]
    x, vr = _slice(full, world, rank).clone(), _slice(v, world, rank).clone()

    def f(s):
        tied = replicate(s, replicas, grad_scale=1.0 / replicas.size())
        return (ff.all_gather(tied, shards, grad_scale=1.0 / world).sin() * c).sum()

    def ref(z):
        return (z.sin() * cs).sum(1).mean()

    grad, hess = torch.func.grad(ref)(full), torch.func.hessian(ref)(full)
    torch.testing.assert_close(torch.func.grad(f)(x), _slice(grad, world, rank), **TOL)
    hv = hess @ v
    torch.testing.assert_close(torch.func.jvp(torch.func.grad(f), (x,), (vr,))[1], _slice(hv, world, rank), **TOL)
    got = torch.func.grad(lambda s: torch.dot(torch.func.grad(f)(s), vr))(x)
    torch.testing.assert_close(got, _slice(hv, world, rank) / world, **TOL)
    # MAML: both averages (shards and replicas) taken once at the outer derivative
    got = torch.func.grad(lambda s: f(s - 0.3 * torch.func.grad(f)(s)))(x)
    want = torch.func.grad(lambda z: ref(z - 0.3 * torch.func.grad(ref)(z)))(full)
    torch.testing.assert_close(got, _slice(want, world, rank), **TOL)
    # the sum over ranks: its tangent, batch and transpose
    y, t = (torch.randn(5, generator=g, dtype=torch.float64) + torch.distributed.get_rank() for _ in range(2))
    total = all_reduce_sum(y, replicas, scale=0.5)
    out, tangent = torch.func.jvp(lambda a: all_reduce_sum(a, replicas, scale=0.5), (y,), (t,))
    torch.testing.assert_close(out, total)
    torch.testing.assert_close(tangent, all_reduce_sum(t, replicas, scale=0.5))
    ys = torch.stack([y, t, y * t])
    got = torch.vmap(lambda a: all_reduce_sum(a, replicas, scale=0.5), in_dims=1)(ys.T.contiguous())
    torch.testing.assert_close(got, torch.stack([all_reduce_sum(e, replicas, scale=0.5) for e in ys]))
    _, pull = torch.func.vjp(lambda a: all_reduce_sum(a, replicas, scale=0.5), y)
    torch.testing.assert_close(pull(t)[0], all_reduce_sum(t, replicas, scale=0.5))
    return True


def test_hybrid_replicas_tie_through_every_transform(pool):
    assert all(pool.run(_hybrid_pair, world=4))


def _maml(group, mesh, inner):
    """One MAML meta-gradient of an MLP through the library's paths: the inner step by
    ``torch.func.grad`` of ``apply_sharded``, by ``value_and_grad`` or by plain autograd
    (shards that require grad, ``create_graph=True``); the outer loss by ``apply_sharded``."""
    from tests.helpers import MLP

    layout = fft.LayoutSpec(*mesh)
    place = layout.group()
    ranks, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    torch.manual_seed(0)
    module = MLP().double()
    fn = ff.functionalize(module)
    plan = ff.make_plan(module, ff.layer_policy([torch.nn.Linear]))
    params = ff.shard(fn.params, plan, place)
    world, shard_rank = params.layout.world, params.layout.rank
    flats = {u: ff.all_gather(s.detach(), params.layout.group) for u, s in params.shards.items()}
    g = torch.Generator().manual_seed(3)
    xin, xout = (torch.randn(2 * ranks, 7, generator=g, dtype=torch.float64) for _ in range(2))
    yin, yout = (torch.randn(2 * ranks, 3, generator=g, dtype=torch.float64) for _ in range(2))
    mine = lambda t: t[2 * rank : 2 * rank + 2]  # noqa: E731
    lr = 0.4

    def ref_loss(f, x, y):
        full = {}
        for unit in plan.units:
            full.update(unit_views(unit, f[unit.name]))
        return _loss_fn(lambda x: fn(full, fn.buffers, x), (x, y))

    def ref_meta(f):
        gi = torch.func.grad(ref_loss)(f, xin, yin)
        return ref_loss({u: f[u] - lr * gi[u] for u in f}, xout, yout)

    want = {u: v.unflatten(0, (world, -1))[shard_rank] for u, v in torch.func.grad(ref_meta)(flats).items()}

    def loss(s, x, y):
        return _loss_fn(lambda x: ff.apply_sharded(fn, params.replace(s), fn.buffers, x), (x, y))

    def inner_grad(s):
        if inner == "value_and_grad":
            return ff.value_and_grad(fn, _loss_fn)(params.replace(s), fn.buffers, (mine(xin), mine(yin)))[1].shards
        if inner == "autograd":
            ss = list(s.values())
            return dict(zip(s, torch.autograd.grad(loss(s, mine(xin), mine(yin)), ss, create_graph=True), strict=True))
        return torch.func.grad(loss)(s, mine(xin), mine(yin))

    def meta(s):
        gi = inner_grad(s)
        return loss({u: s[u] - lr * gi[u] for u in s}, mine(xout), mine(yout))

    if inner == "autograd":
        leaves = {u: v.detach().requires_grad_() for u, v in params.shards.items()}
        got = dict(zip(leaves, torch.autograd.grad(meta(leaves), list(leaves.values())), strict=True))
    else:
        got = torch.func.grad(meta)(params.shards)
    torch.testing.assert_close(got, want, **TOL)
    return True


@pytest.mark.parametrize("inner", ["func_grad", "value_and_grad", "autograd"])
@pytest.mark.parametrize("mesh", [(2, 1), (3, 1), (4, 2)], ids=["2", "3", "hybrid-2x2"])
def test_maml_meta_gradient_equals_one_process(pool, mesh, inner):
    # Catches: the inner gradient's average taken a second time by the outer derivative (the
    # meta-gradient's second-order term 1/W too small), a replica axis averaged twice, a walk
    # that misses the inner step's shard inside torch.func's own level, or plain autograd.
    assert all(pool.run(_maml, mesh, inner, world=mesh[0]))


# --- whole models, through each path ---------------------------------------------------


def _forward(path, fn, params, buffers, x):
    """The model's output from sharded ``params`` along one of the library's paths."""
    if path == "gather_for":
        full = {}
        for unit in params.plan.units:
            full.update(ff.gather_for(unit)(params))
        return fn(full, buffers, x)
    return ff.apply_sharded(fn, params, buffers, x)


def _loss_fn(model, batch):
    # By hand: torch's F.mse_loss fails forward-over-reverse (jvp of grad) with "ZeroTensors are immutable".
    x, y = batch
    return (model(x) - y).square().mean()


def _model_transform(group, path, transform, spec, plan_spec):
    world, rank = group.size(), group.rank()
    module = spec.build()
    fn = ff.functionalize(module)
    plan = plan_spec.make(module)
    params = ff.shard(fn.params, plan, group)
    shards = params.shards
    flats = {u: ff.all_gather(s, group) for u, s in shards.items()}  # the reference's (padded) coordinates
    frozen = {k: v for k, v in fn.params.items() if not v.requires_grad}

    def ref_forward(flat, x):
        full = dict(frozen)
        for unit in plan.units:
            full.update(unit_views(unit, flat[unit.name]))
        return fn(full, fn.buffers, x)

    def forward(s, x):
        return _forward(path, fn, params.replace(s), fn.buffers, x)

    def loss(s, batch):
        if path == "value_and_grad":
            raise AssertionError("value_and_grad gives gradients only")
        return _loss_fn(lambda x: forward(s, x), batch)

    def ref_loss(flat, batch):
        return _loss_fn(lambda x: ref_forward(flat, x), batch)

    def grad_of(s, batch):
        if path == "value_and_grad":
            return ff.value_and_grad(fn, _loss_fn)(params.replace(s), fn.buffers, batch)[1].shards
        return torch.func.grad(loss)(s, batch)

    mine = lambda t: {u: _slice(v, world, rank) for u, v in t.items()}  # noqa: E731
    close = functools.partial(torch.testing.assert_close, **TOL)
    g = torch.Generator().manual_seed(spec.seed + 1)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=spec.dtype)  # noqa: E731
    batch = spec.batch(2 * world, seed=spec.seed)  # the global batch; this rank's part:
    local = fft.split_batch(batch, rank, world)
    tangent = {u: rand(f.shape) for u, f in flats.items()}  # replicated draw: slice it per rank
    for unit in plan.units:  # padding carries no tangent
        tangent[unit.name][unit.numel :] = 0

    if transform == "grad":
        close(grad_of(shards, local), mine(torch.func.grad(ref_loss)(flats, batch)))
    elif transform == "vjp":
        out, pull = torch.func.vjp(lambda s: forward(s, local[0]), shards)
        ref_out, ref_pull = torch.func.vjp(lambda f: ref_forward(f, batch[0]), flats)
        cot = rand(ref_out.shape)
        close(out, fft.split_batch(ref_out, rank, world))
        close(pull(fft.split_batch(cot, rank, world))[0], mine({u: v / world for u, v in ref_pull(cot)[0].items()}))
    elif transform == "jvp":
        out, tan = torch.func.jvp(lambda s: forward(s, local[0]), (shards,), (mine(tangent),))
        ref_out, ref_tan = torch.func.jvp(lambda f: ref_forward(f, batch[0]), (flats,), (tangent,))
        close(out, fft.split_batch(ref_out, rank, world))
        close(tan, fft.split_batch(ref_tan, rank, world))
    elif transform == "per_example_grads":  # every rank vmaps over the same global batch
        one = lambda s, x, y: grad_of(s, (x[None], y[None]))  # noqa: E731
        got = torch.vmap(one, in_dims=(None, 0, 0))(shards, *batch)
        want = torch.vmap(torch.func.grad(lambda f, x, y: ref_loss(f, (x[None], y[None]))), in_dims=(None, 0, 0))(
            flats, *batch
        )
        close(got, mine(want))
    elif transform in ("jacrev", "jacfwd"):
        x = batch[0][:2]  # replicated
        jac = getattr(torch.func, transform)
        got = jac(lambda s: forward(s, x))(shards)
        want = jac(lambda f: ref_forward(f, x))(flats)
        close(got, mine(want) if transform == "jacrev" else {u: _fold(v, world) for u, v in want.items()})
    elif transform in ("hvp_jvp_of_grad", "hvp_grad_of_grad"):
        # the reference by reverse over reverse: an independent check of the forward-over-reverse one
        hv = torch.func.grad(
            lambda f: sum(torch.dot(g_, tangent[u]) for u, g_ in torch.func.grad(ref_loss)(f, batch).items())
        )(flats)
        if transform == "hvp_jvp_of_grad":
            got = torch.func.jvp(lambda s: grad_of(s, local), (shards,), (mine(tangent),))[1]
            close(got, mine(hv))
        else:
            v = mine(tangent)
            partial_dot = lambda s: sum(torch.dot(g_, v[u]) for u, g_ in grad_of(s, local).items())  # noqa: E731
            close(torch.func.grad(partial_dot)(shards), {u: t / world for u, t in mine(hv).items()})
    elif transform == "maml":  # the outer loss on other data after two inner steps on the rank's batch
        lr, outer = 0.3, spec.batch(2 * world, seed=spec.seed + 7)
        outer_loss = (
            loss
            if path != "value_and_grad"
            else lambda s, b: _loss_fn(lambda x: _forward("apply_sharded", fn, params.replace(s), fn.buffers, x), b)
        )

        def meta(s):
            for _ in range(2):
                s = {u: v - lr * g_ for (u, v), g_ in zip(s.items(), grad_of(s, local).values(), strict=True)}
            return outer_loss(s, fft.split_batch(outer, rank, world))

        def ref_meta(f):
            for _ in range(2):
                f = {
                    u: v - lr * g_
                    for (u, v), g_ in zip(f.items(), torch.func.grad(ref_loss)(f, batch).values(), strict=True)
                }
            return ref_loss(f, outer)

        close(torch.func.grad(meta)(shards), mine(torch.func.grad(ref_meta)(flats)))
    elif transform == "hessian":  # replicated batch: jacfwd of the gradient
        got = torch.func.jacfwd(lambda s: grad_of(s, batch))(shards)
        want = torch.func.hessian(ref_loss)(flats, batch)
        close(
            got,
            {
                u: {v: _fold(_slice(h.transpose(0, 1), world, rank).transpose(0, 1), world) for v, h in row.items()}
                for u, row in want.items()
            },
        )
    elif transform == "hessian_rev":  # reverse over reverse: a cotangent basis vector on every rank at once
        got = torch.func.jacrev(lambda s: grad_of(s, batch))(shards)
        want = torch.func.hessian(ref_loss)(flats, batch)
        close(
            got,
            {
                u: {
                    v: _slice(_fold(h.transpose(0, 1), world).transpose(0, 1), world, rank) / world
                    for v, h in row.items()
                }
                for u, row in want.items()
            },
        )
    else:
        raise ValueError(transform)
    return True


TRANSFORMS = [
    "grad",
    "vjp",
    "jvp",
    "per_example_grads",
    "jacrev",
    "jacfwd",
    "hvp_jvp_of_grad",
    "hvp_grad_of_grad",
    "hessian",
    "hessian_rev",
    "maml",
]
GRADIENT_TRANSFORMS = [
    "grad",
    "per_example_grads",
    "hvp_jvp_of_grad",
    "hvp_grad_of_grad",
    "hessian",
    "hessian_rev",
    "maml",
]


def _check(pool, path, transform, spec, plan, world):
    assert all(pool.run(_model_transform, path, transform, spec, plan, world=world))


@pytest.mark.parametrize("transform", TRANSFORMS)
@settings(max_examples=5)
@given(spec=fft.models(depth=(1, 2), frozen=False), plan=fft.plans(), world=fft.worlds())
def test_transforms_through_gather_for(pool, transform, spec, plan, world):
    _check(pool, "gather_for", transform, spec, plan, world)


@pytest.mark.parametrize("transform", TRANSFORMS)
@settings(max_examples=5)
@given(spec=fft.models(depth=(1, 2)), plan=fft.plans(), world=fft.worlds())
def test_transforms_through_apply_sharded(pool, transform, spec, plan, world):
    _check(pool, "apply_sharded", transform, spec, plan, world)


@pytest.mark.parametrize("transform", GRADIENT_TRANSFORMS)
@settings(max_examples=5)
@given(spec=fft.models(depth=(1, 2)), plan=fft.plans(), world=fft.worlds())
def test_transforms_through_value_and_grad(pool, transform, spec, plan, world):
    _check(pool, "value_and_grad", transform, spec, plan, world)


# --- the research examples (examples/research.py) ---------------------------------------


def _reference(world, per_rank=3):
    from examples import research

    module = research.make_model()
    params = {k: p.detach() for k, p in module.named_parameters()}
    x, y = research.data(world, per_rank)

    def loss(p, x, y):
        return research.squared_error(lambda inp: torch.func.functional_call(module, p, (inp,)), x, y)

    return module, params, x, y, loss


def _research(group):
    from examples import research

    world = group.size()
    module, full, x, y, loss = _reference(world)
    plan = ff.make_plan(module, ff.layer_policy([torch.nn.Linear]))
    as_shards = lambda tree: ff.shard(tree, plan, group).shards  # noqa: E731  (this rank's slice of full tensors)
    close = functools.partial(torch.testing.assert_close, **TOL)

    # DP-SGD: per-example norms and the clipped mean gradient
    clip = 2.0
    per_example = torch.vmap(torch.func.grad(lambda p, xi, yi: loss(p, xi[None], yi[None])), in_dims=(None, 0, 0))(
        full, x, y
    )
    norms = sum(g.flatten(1).square().sum(1) for g in per_example.values()).sqrt()
    factor = (clip / norms).clamp(max=1.0)
    clipped = {k: (factor.view(-1, *[1] * (g.dim() - 1)) * g).mean(0) for k, g in per_example.items()}
    got = research.dp_sgd_gradient(group, clip=clip)
    close(got["norms"], norms)
    assert (norms > clip).any() and (norms < clip).any()  # some examples clipped, some not
    close(got["grad"], as_shards(clipped))

    # Hessian-vector product, and power iteration against the same iteration unsharded and the spectrum
    params, v, hvp = research.hessian_vector_product(group)
    g = torch.Generator().manual_seed(7)
    v_full = {k: torch.randn(p.shape, generator=g, dtype=p.dtype) for k, p in full.items()}
    close(v, as_shards(v_full))

    def ref_hvp(vec):
        return torch.func.jvp(lambda p: torch.func.grad(loss)(p, x, y), (full,), (vec,))[1]

    close(hvp(v), as_shards(ref_hvp(v_full)))
    top = research.top_hessian_eigenvalue(group, iterations=30)
    vec, history = v_full, []
    for _ in range(30):
        norm = torch.sqrt(sum(t.square().sum() for t in vec.values()))
        vec = {k: t / norm for k, t in vec.items()}
        hv = ref_hvp(vec)
        history.append(float(sum((vec[k] * hv[k]).sum() for k in vec)))
        vec = hv
    close(torch.tensor(top["history"]), torch.tensor(history))
    flat = torch.cat([p.reshape(-1) for p in full.values()])

    def flat_loss(f):
        pieces = f.split([p.numel() for p in full.values()])
        return loss({k: t.view(full[k].shape) for k, t in zip(full, pieces, strict=True)}, x, y)

    spectrum = torch.linalg.eigvalsh(torch.func.hessian(flat_loss)(flat))
    top_abs = spectrum[spectrum.abs().argmax()]
    assert abs(top["eigenvalue"] - float(top_abs)) < 1e-3 * abs(float(top_abs))

    # forward mode: the directional derivative equals the reference's and <grad, v>
    got = research.directional_derivative(group)
    value, slope = torch.func.jvp(lambda p: loss(p, x, y), (full,), (v_full,))
    assert abs(got["loss"] - float(value)) < 1e-12 * max(1.0, abs(float(value)))
    assert abs(got["jvp"] - float(slope)) < 1e-10 and abs(got["dot"] - float(slope)) < 1e-10
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_research_examples(pool, world):
    assert all(pool.run(_research, world=world))


def _uneven_vmap(group):
    """Per-example gradients over this rank's own examples, 2 + rank of them, then as many on every rank."""
    from examples import research

    rank = group.rank()
    fn, params = research.setup(group)
    model = research.model_on(fn, params)

    def one(shards, xi, yi):
        return research.squared_error(model(shards), xi[None], yi[None])

    per_example = torch.vmap(torch.func.grad(one), in_dims=(None, 0, 0))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)
    try:
        per_example(params.shards, x[: 2 + rank], y[: 2 + rank])
    except ValueError as e:
        message = str(e)
    else:
        message = ""
    # the group is still usable: equal batches give the per-example gradients, summing to the batch's
    got = per_example(params.shards, x[:2], y[:2])
    want = torch.func.grad(lambda s: sum(one(s, x[i], y[i]) for i in range(2)))(params.shards)
    return message, max((got[u].sum(0) - want[u]).abs().max().item() for u in want)


@pytest.mark.parametrize("world", [2, 3])
def test_vmap_over_batches_of_different_sizes_raises_on_every_rank(pool, world):
    # Catches: the vmapped reduce-scatter sent batches of different sizes (gloo aborted the process:
    # "Received data size doesn't match expected size").
    sizes = ", ".join(f"rank {r}: {2 + r}" for r in range(world))
    for message, diff in pool.run(_uneven_vmap, world=world):
        assert message.startswith("vmap over a batch of different sizes on the ranks of group '"), message
        assert f"' ({sizes}) at the reduce-scatter of unit" in message, message
        assert "pad the smaller batches" in message
        assert diff < 1e-12
