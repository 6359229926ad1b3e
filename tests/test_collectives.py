"""gather/reduce-scatter: one differentiable pair, each the other's transpose."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdp_fn as ff
from fsdp_fn import _collectives as C


def _transpose(group, examples):
    world, rank = group.size(), group.rank()

    @settings(max_examples=examples)
    @given(n=st.integers(0, 17), seed=st.integers(0, 2**16))
    def prop(n, seed):
        g = torch.Generator().manual_seed(seed * 31 + rank)  # different data on every rank
        x = torch.randn(n, generator=g, dtype=torch.float64)
        y = torch.randn(n * world, generator=g, dtype=torch.float64)
        lhs = torch.dot(ff.all_gather(x, group), y).reshape(1)
        rhs = torch.dot(x, ff.reduce_scatter_sum(y, group)).reshape(1)
        C.all_reduce_(lhs, group)
        C.all_reduce_(rhs, group)
        torch.testing.assert_close(lhs, rhs)
        # autograd agrees: the vjp of each is the other
        _, vjp_ag = torch.func.vjp(lambda s: ff.all_gather(s, group), x)
        torch.testing.assert_close(vjp_ag(y)[0], ff.reduce_scatter_sum(y, group))
        _, vjp_rs = torch.func.vjp(lambda f: ff.reduce_scatter_sum(f, group), y)
        torch.testing.assert_close(vjp_rs(x)[0], ff.all_gather(x, group))

    prop()
    return True


def test_all_gather_and_reduce_scatter_are_transposes(pool):
    for world in (1, 2, 3, 4):
        assert all(pool.run(_transpose, 15, world=world))


def _grad_of_grad(group):
    world = group.size()
    x = torch.arange(3.0, dtype=torch.float64) + group.rank()

    def f(s):
        full = ff.all_gather(s, group)
        return (full**3).sum()

    # d/ds sum(AG(s)^3) = RS(3 AG(s)^2) = 3 W s^2 (each rank's slice counted on every rank)
    g = torch.func.grad(f)(x)
    torch.testing.assert_close(g, 3 * world * x**2)
    h = torch.func.grad(lambda s: torch.func.grad(f)(s).sum())(x)
    torch.testing.assert_close(h, 6 * world * x)
    return True


def test_grad_of_grad(pool):
    assert all(pool.run(_grad_of_grad, world=3))


def _round_trip(group, examples):
    @settings(max_examples=examples)
    @given(
        shapes=st.lists(st.lists(st.integers(1, 6), min_size=0, max_size=3), min_size=1, max_size=5),
        seed=st.integers(0, 100),
    )
    def prop(shapes, seed):
        torch.manual_seed(seed)
        m = nn.Module()
        for i, s in enumerate(shapes):
            m.register_parameter(f"p{i}", nn.Parameter(torch.randn(tuple(s))))  # s == [] is a scalar
        plan = ff.make_plan(m)
        params = dict(m.named_parameters())
        sharded = ff.shard(params, plan, group)
        unit = plan.units[0]
        assert sharded[""].shape == (unit.shard_numel(group.size()),)
        full = ff.unshard(sharded)
        for k, v in params.items():
            assert torch.equal(full[k], v.detach())

    prop()
    return True


def test_shard_unshard_round_trip(pool):
    for world in (1, 2, 3, 4):
        assert all(pool.run(_round_trip, 15, world=world))


def _gather_for_and_reduce_grads(group):
    """gather_for inside grad/vjp; reduce_grads equals the gradient of the gathered forward."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    m = nn.Linear(5, 3)  # 18 elements: shards padded at W=4
    plan = ff.make_plan(m)
    params = ff.shard(dict(m.named_parameters()), plan, group)
    x = torch.randn(4, 5) + rank

    def loss(shards):
        full = ff.gather_for("")(params.replace(shards))
        return (x @ full["weight"].T + full["bias"]).square().mean()

    g1 = torch.func.grad(loss)(params.shards)
    g2, value = torch.func.grad_and_value(loss)(params.shards)
    value2, vjp = torch.func.vjp(loss, params.shards)
    (g3,) = vjp(torch.ones(()))
    # By hand: full gradient here, then reduce_grads averages and scatters it.
    full = {k: v.detach().requires_grad_() for k, v in ff.unshard(params).items()}
    (x @ full["weight"].T + full["bias"]).square().mean().backward()
    g4 = ff.reduce_grads({k: v.grad for k, v in full.items()}, params)
    for g in (g2, g3, g4.shards):
        torch.testing.assert_close(g[""], g1[""])
    assert g4[""].shape == (plan.units[0].shard_numel(world),)
    return True


def test_gather_for_and_reduce_grads(pool):
    for world in (1, 2, 4):
        assert all(pool.run(_gather_for_and_reduce_grads, world=world))


def test_sharded_is_a_pytree():
    import optree

    leaves, spec = optree.tree_flatten({"a": 1}, namespace=ff.NAMESPACE)
    assert leaves == [1]
    assert spec.num_leaves == 1


def _grad_through_apply_sharded(group):
    """A user's own functional step: torch.func.grad over apply_sharded gives the averaged gradient."""
    rank = group.rank()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    fn = ff.functionalize(m)
    params = ff.shard(fn.params, ff.make_plan(m, ff.layer_policy([nn.Linear])), group)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))

    def loss(shards):
        return ff.apply_sharded(fn, params.replace(shards), fn.buffers, x).square().mean()

    for transform in (torch.func.grad, lambda f: lambda p: torch.func.grad_and_value(f)(p)[0]):
        got = transform(loss)(params.shards)
        full = {k: v.detach().requires_grad_() for k, v in fn.params.items()}
        fn(full, fn.buffers, x).square().mean().backward()
        want = ff.reduce_grads({k: v.grad for k, v in full.items()}, params)
        for unit in params:
            torch.testing.assert_close(got[unit], want[unit])
    return True


def test_grad_through_apply_sharded(pool):
    for world in (2, 3):
        assert all(pool.run(_grad_through_apply_sharded, world=world))
