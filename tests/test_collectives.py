"""gather/reduce-scatter: one differentiable pair, each the other's transpose.

Every reference here is torch's own collective (``dist.all_gather_into_tensor``,
``dist.all_reduce`` then this rank's slice) or a closed form, never fsdp_fn's
reduce-scatter compared with itself.
"""

from __future__ import annotations

import math
import os
import threading

import optree
import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as torch_pytree
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdp_fn as ff
from fsdp_fn import _collectives as C
from fsdp_fn import _comm
from tests.helpers import native_collectives

_native = native_collectives  # the backend's own all-gather/reduce-scatter instead of the pairwise exchange


def _torch_all_gather(x: torch.Tensor, group) -> torch.Tensor:
    out = [torch.empty_like(x) for _ in range(group.size())]
    dist.all_gather(out, x.contiguous(), group=group)
    return torch.cat(out)


def _torch_reduce_scatter(y: torch.Tensor, group, scale: float = 1.0) -> torch.Tensor:
    """The independent reference: all-reduce the whole buffer, scale, keep this rank's slice."""
    total = y.clone()
    dist.all_reduce(total, group=group)
    return (total * scale).chunk(group.size())[group.rank()]


SCALES = (1.0, 0.25, 2.0, 0.0)  # 1: no multiply; 1/W-like; > 1; 0 (every branch on the scale)


def _against_torch(group, examples, native):
    world, rank = group.size(), group.rank()

    @settings(max_examples=examples)
    @given(n=st.integers(0, 17), seed=st.integers(0, 2**16))
    def prop(n, seed):
        g = torch.Generator().manual_seed(seed * 31 + rank)  # different data on every rank
        x = torch.randn(n, generator=g, dtype=torch.float64)
        y = torch.randn(n * world, generator=g, dtype=torch.float64)
        # Catches: chunks gathered in the wrong order or to the wrong place.
        torch.testing.assert_close(ff.all_gather(x, group), _torch_all_gather(x, group), rtol=0, atol=0)
        for scale in SCALES:
            # Catches: a missing or doubled scale, a scale skipped for some value.
            torch.testing.assert_close(
                ff.reduce_scatter_sum(y, group, scale=scale), _torch_reduce_scatter(y, group, scale)
            )
            # Catches: a backward that is not the transpose (wrong collective, scale applied twice or not at all).
            _, vjp_ag = torch.func.vjp(lambda s, scale=scale: ff.all_gather(s, group, grad_scale=scale), x)
            torch.testing.assert_close(vjp_ag(y)[0], _torch_reduce_scatter(y, group, scale))
            _, vjp_rs = torch.func.vjp(lambda f, scale=scale: ff.reduce_scatter_sum(f, group, scale=scale), y)
            torch.testing.assert_close(vjp_rs(x)[0], scale * _torch_all_gather(x, group))
        if world == 1 and n:  # Catches: a copy where one rank has nothing to reduce (the docstring says none).
            assert ff.reduce_scatter_sum(y, group).data_ptr() == y.data_ptr()
        # The design's property, with both sides summed by torch: <AG(x), y> == <x, RS(y)>.
        lhs = torch.dot(ff.all_gather(x, group), y).reshape(1)
        rhs = torch.dot(x, ff.reduce_scatter_sum(y, group)).reshape(1)
        dist.all_reduce(lhs, group=group)
        dist.all_reduce(rhs, group=group)
        torch.testing.assert_close(lhs, rhs)

    with _native(native):
        prop()
    return True


@pytest.mark.parametrize("native", [False, True], ids=["pairwise", "native"])
def test_all_gather_and_reduce_scatter_match_torch(pool, native):
    for world in (1, 2, 3, 4):
        assert all(pool.run(_against_torch, 8, native, world=world))


def _all_reduce_and_broadcast(group):
    world, rank = group.size(), group.rank()
    mine = torch.arange(5.0) * (rank + 1)
    summed = C.all_reduce_(mine.clone(), group)
    from_last = C.broadcast_(mine.clone(), group, src=world - 1)
    from_first = C.broadcast_(mine.clone(), group)
    return (
        torch.equal(summed, torch.arange(5.0) * sum(range(1, world + 1))),
        torch.equal(from_last, torch.arange(5.0) * world),
        torch.equal(from_first, torch.arange(5.0)),
    )


def test_all_reduce_and_broadcast(pool):
    # Catches: a collective skipped at some group size, a broadcast from the wrong rank (default: rank 0).
    for world in (1, 2, 3, 4):
        assert all(all(r) for r in pool.run(_all_reduce_and_broadcast, world=world))


def test_collective_records_count_ring_bytes():
    # Catches: a wrong byte count in the log (the all-reduce's ring sends twice (W-1)/W of the buffer).
    gather = C.Collective("all_gather", "u", 12, torch.float32, 4)
    reduce = C.Collective("all_reduce", None, 12, torch.float64, 4)
    assert (gather.bytes, gather.ring_bytes) == (48, 36.0)
    assert (reduce.bytes, reduce.ring_bytes) == (96, 144.0)
    log = C.CommLog([gather, reduce, gather])
    assert log.of("all_gather") == [gather, gather] and log.of("broadcast") == []
    assert (log.bytes(), log.bytes("all_reduce"), log.ring_bytes()) == (192, 96, 216.0)


PG = torch._C._distributed_c10d.ProcessGroup  # every point-to-point send passes its send


def _on_sockets(fn):
    """Run ``fn(group)`` with the group's messages on gloo's sockets (``PairwiseComm``), not shared memory."""

    def run(group):
        saved = ff.set_comm(group, _comm.PairwiseComm(group))
        try:
            return fn(group)
        finally:
            ff.set_comm(group, saved)

    run.__name__ = run.__qualname__ = fn.__name__  # (pickled by name to the ranks)
    return run


@_on_sockets
def _sends_on_the_sender_thread(group):
    world, rank = group.size(), group.rank()
    seen = []
    send = PG.__dict__["send"]  # (the descriptor: put back as it was, it binds again)
    call = PG.send

    def spy(pg, tensors, peer, tag=0):
        seen.append((threading.current_thread().name, tag, tensors[0].numel() * tensors[0].element_size()))
        return call(pg, tensors, peer, tag)

    big = _comm.SENDER_BYTES // 4  # float32 elements per shard: a send this large leaves from the sender thread
    PG.send = spy
    try:
        shard = torch.arange(float(big)) + 10 * rank
        out = torch.empty(big * world)
        pending = C.all_gather_into(out, shard, group, "u", async_op=True)
        # The user's own point-to-point on the same group, default tag, while ours is in flight.
        peer = (rank + 1) % world
        mine, theirs = torch.full((6,), -1.0 - rank), torch.empty(6)
        user = [
            dist.isend(mine, group=group, group_dst=peer),
            dist.irecv(theirs, group=group, group_src=(rank - 1) % world),
        ]
        # Small sends right behind the large ones: they must not overtake them (gloo matches in order).
        summed = C.reduce_scatter(torch.ones(6 * world) * (rank + 1), group, "u")
        pending.wait()
        for w in user:
            w.wait()
        # Once the queue has drained, a small send leaves from the step's own thread: no hand-off.
        seen.clear()
        again = C.reduce_scatter(torch.ones(6 * world) * (rank + 1), group, "u")
    finally:
        PG.send = send
    ours_small = [s for s in seen if s[1] == _comm.TAG]

    # A send whose issue fails reaches the thread that waits on it.
    def refuse(*args, **kwargs):
        raise RuntimeError("refused")

    PG.send = refuse
    try:
        failed = _comm._QueuedSend(torch.ones(1), group, (rank + 1) % world)
        failed.wait()
        raised = False
    except RuntimeError as e:
        raised = str(e) == "refused"
    finally:
        PG.send = send
    expected = (torch.arange(float(big)) + 10 * torch.arange(world)[:, None]).view(-1)
    return (
        len(ours_small) == world - 1 and all(name == "MainThread" for name, _, _ in ours_small),
        torch.equal(out, expected),
        torch.equal(theirs, torch.full((6,), -1.0 - (rank - 1) % world)),
        torch.equal(summed, torch.full((6,), world * (world + 1) / 2)),
        torch.equal(again, summed),
        raised,
        _comm._last is not None and _comm._last.issued.is_set(),
    )


@_on_sockets
def _large_sends_leave_from_the_sender_thread(group):
    world, rank = group.size(), group.rank()
    names = []
    send = PG.__dict__["send"]  # (the descriptor: put back as it was, it binds again)
    call = PG.send

    def spy(pg, tensors, peer, tag=0):
        if tag == _comm.TAG:
            names.append(threading.current_thread().name)
        return call(pg, tensors, peer, tag)

    PG.send = spy
    try:
        big = _comm.SENDER_BYTES // 4
        out = torch.empty(big * world)
        C.all_gather_into(out, torch.full((big,), float(rank)), group, "u")
    finally:
        PG.send = send
    return names == ["fsdp_fn-send"] * (world - 1) and torch.equal(
        out, torch.arange(world).repeat_interleave(big).float()
    )


def test_sends_leave_from_the_sender_thread(pool):
    # Catches: large sends issued on the step's thread (the second rank to arrive would copy every
    # payload there); a small send issued on the step's thread while a large one still waits in the
    # queue (it would overtake it: gloo matches messages in order); small sends handed over after
    # the queue drained (a hand-off per message); fsdp_fn's messages matched with a user's own on
    # the default tag; a send that failed to issue lost on the sender thread (its waiter would hang).
    for world in (2, 3):
        assert all(all(r) for r in pool.run(_sends_on_the_sender_thread, world=world))
        assert all(pool.run(_large_sends_leave_from_the_sender_thread, world=world))


def test_a_forked_child_starts_its_own_sender_thread():
    # Catches: a child forked after the first send reusing the parent's queue, which no thread serves
    # there (its sends would never leave).
    assert _comm._sender() is _comm._sender()  # one queue, one thread, in this process
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _comm._sends is None and _comm._sender() is not None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _rank_order(group):
    world, rank = group.size(), group.rank()
    n = 16
    # Rank r sends the same vector v_r to every rank, so every rank's shard is v_0 + ... + v_{W-1}.
    # Magnitudes spread over 12 decades: float32 addition order changes the last bits.
    parts = []
    for r in range(world):
        g = torch.Generator().manual_seed(100 + r)
        parts.append(torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 6, (n,), generator=g).float())
    ordered = parts[0].clone()
    for p in parts[1:]:
        ordered += p
    own_first = parts[rank].clone()
    for j in (j for j in range(world) if j != rank):
        own_first += parts[j]
    got = ff.reduce_scatter_sum(parts[rank].repeat(world), group)
    scaled = ff.reduce_scatter_sum(parts[rank].repeat(world), group, scale=1 / 3)
    everyone = _torch_all_gather(got, group).view(world, n)
    return (
        torch.equal(got, ordered),
        all(torch.equal(everyone[0], row) for row in everyone),
        torch.equal(scaled, ordered * (1 / 3)),
        not torch.equal(own_first, ordered),
    )


def test_reduce_scatter_sums_in_rank_order_on_every_rank(pool):
    # Catches: summing in arrival order or own part first (ranks disagree in the last bits).
    for world in (3, 4):
        results = pool.run(_rank_order, world=world)
        for got_ordered, ranks_agree, scaled_ordered, _ in results:
            assert got_ordered and ranks_agree and scaled_ordered
        assert any(order_matters for *_, order_matters in results)  # the data can tell the orders apart


def _grad_of_grad(group):
    world = group.size()
    x = torch.arange(3.0, dtype=torch.float64) + group.rank()

    def f(s):
        full = ff.all_gather(s, group)
        return (full**3).sum()

    # Catches: a backward that drops the outer transform's graph (grad-of-grad silently zero).
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
        # Catches: a shard of the wrong size, slices at wrong offsets, lost padding.
        assert sharded[""].shape == (unit.shard_numel(group.size()),)
        flat = torch.cat([v.detach().reshape(-1) for v in params.values()])
        flat = torch.cat([flat, flat.new_zeros(unit.padded_numel(group.size()) - flat.numel())])
        assert torch.equal(sharded[""], flat.chunk(group.size())[group.rank()])
        full = ff.unshard(sharded)
        for k, v in params.items():
            assert torch.equal(full[k], v.detach())

    prop()
    return True


def test_shard_unshard_round_trip(pool):
    for world in (1, 2, 3, 4):
        assert all(pool.run(_round_trip, 15, world=world))


def _flat_slice(grads: list[torch.Tensor], group) -> torch.Tensor:
    """This rank's slice of the flat, zero-padded concatenation of ``grads`` (no fsdp_fn code)."""
    world = group.size()
    flat = torch.cat([g.reshape(-1) for g in grads])
    pad = math.ceil(flat.numel() / world) * world - flat.numel()
    return torch.cat([flat, flat.new_zeros(pad)]).chunk(world)[group.rank()]


def _gather_for_and_reduce_grads(group, mean):
    """gather_for inside grad/vjp, and reduce_grads, against all-reduce-then-slice."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    m = nn.Linear(5, 3)  # 18 elements: shards padded at W=4
    plan = ff.make_plan(m)
    params = ff.shard(dict(m.named_parameters()), plan, group)
    x = torch.randn(4, 5) + rank

    def loss(shards):
        full = ff.gather_for("")(params.replace(shards))
        return (x @ full["weight"].T + full["bias"]).square().mean()

    # Independent reference: this rank's full gradient by plain autograd, all-reduced by torch,
    # divided by W, then this rank's slice of the flat padded buffer (weight, then bias).
    w, b = (t.detach().clone().requires_grad_() for t in (m.weight, m.bias))
    (x @ w.T + b).square().mean().backward()
    summed = [w.grad.clone(), b.grad.clone()]
    for t in summed:
        dist.all_reduce(t, group=group)
    want = _flat_slice([t / world for t in summed], group)
    # Catches: a missing or doubled 1/W, swapped chunks, gradients of the wrong parameter.
    g1 = torch.func.grad(loss)(params.shards)
    g2, _ = torch.func.grad_and_value(loss)(params.shards)
    _, vjp = torch.func.vjp(loss, params.shards)
    (g3,) = vjp(torch.ones(()))
    for g in (g1, g2, g3):
        torch.testing.assert_close(g[""], want)
    g4 = ff.reduce_grads({"weight": w.grad, "bias": b.grad}, params, mean=mean)
    torch.testing.assert_close(g4[""], want * (1 if mean else world))
    assert g4[""].shape == (plan.units[0].shard_numel(world),)
    return True


@pytest.mark.parametrize("mean", [True, False])
def test_gather_for_and_reduce_grads(pool, mean):
    for world in (1, 2, 4):
        assert all(pool.run(_gather_for_and_reduce_grads, mean, world=world))


def _gather_for_with_frozen(group):
    """A unit with a frozen parameter: gather_for hands it back too (needing no gradient), so
    ``functional_call`` on what it returns needs nothing of the module's own values."""
    torch.manual_seed(0)
    m = nn.Linear(5, 3)
    m.bias.requires_grad_(False)
    params = ff.shard(dict(m.named_parameters()), ff.make_plan(m), group)
    x = torch.randn(4, 5)

    def loss(shards):
        full = ff.gather_for("")(params.replace(shards))
        assert not full["bias"].requires_grad
        with torch.device("meta"):
            bare = nn.Linear(5, 3)  # no values at all: every tensor comes from the gather
        return torch.func.functional_call(bare, full, (x,)).square().mean()

    g = torch.func.grad(loss)(params.shards)
    w = m.weight.detach().clone().requires_grad_()
    (x @ w.T + m.bias).square().mean().backward()
    full = ff.gather_for("")(params)
    return torch.equal(full["bias"], m.bias), torch.allclose(ff.unshard(params.replace(g))["weight"], w.grad)


def test_gather_for_gathers_a_units_frozen_parameters_too(pool):
    for world in (1, 3):
        assert all(all(r) for r in pool.run(_gather_for_with_frozen, world=world))


def _sharded_pytree(group):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    plan = ff.make_plan(m, ff.layer_policy([nn.Linear]))
    s = ff.shard(dict(m.named_parameters()), plan, group)
    n = len(plan.units)
    assert isinstance(s, ff.Sharded) and len(s) == n == 2  # one unit per Linear; the root holds nothing
    # optree, namespace "fsdp_fn": the shards are the leaves, in plan order; the layout rides along.
    leaves, spec = optree.tree_flatten(s, namespace=ff.NAMESPACE)
    assert spec.num_leaves == n and all(a is b for a, b in zip(leaves, s.values()))
    back = optree.tree_unflatten(spec, [t * 2 for t in leaves])
    assert isinstance(back, ff.Sharded) and back.layout == s.layout and list(back) == list(plan.unit_names)
    assert all(torch.equal(back[u], 2 * s[u]) for u in s)
    plus_one = optree.tree_map(lambda t: t + 1, s, namespace=ff.NAMESPACE)
    assert isinstance(plus_one, ff.Sharded) and all(torch.equal(plus_one[u], s[u] + 1) for u in s)
    # Outside the namespace a Sharded is one opaque leaf: the namespace is what makes it a node.
    assert optree.tree_leaves(s) == [s]
    # ff.tree_map over several trees, nested in a container.
    pairs = ff.tree_map(lambda a, b: a - b, {"x": s}, {"x": plus_one})
    assert all(torch.equal(pairs["x"][u], s[u] - plus_one[u]) for u in s)
    # torch's pytree (what torch.func sees): the same leaves and a round trip.
    t_leaves, t_spec = torch_pytree.tree_flatten(s)
    assert all(a is b for a, b in zip(t_leaves, s.values())) and len(t_leaves) == n
    t_back = torch_pytree.tree_unflatten([t.neg() for t in t_leaves], t_spec)
    assert isinstance(t_back, ff.Sharded) and t_back.layout == s.layout
    assert all(torch.equal(t_back[u], -s[u]) for u in s)
    mapped = torch_pytree.tree_map(torch.zeros_like, s)
    assert isinstance(mapped, ff.Sharded) and all(not t.any() for t in mapped.values())
    # torch.func differentiates through the Sharded itself: the gradient is a Sharded too.
    grad = torch.func.grad(lambda p: sum(t.square().sum() for t in p.values()))(s)
    assert isinstance(grad, ff.Sharded) and all(torch.equal(grad[u], 2 * s[u]) for u in s)
    return True


def test_sharded_is_a_pytree(pool):
    # Catches: a Sharded that flattens to the wrong leaves, loses its layout or unit order on
    # unflatten, or is not registered with one of the two pytree libraries.
    assert all(pool.run(_sharded_pytree, world=2))


def _grad_through_apply_sharded(group):
    """A user's own functional step: torch.func.grad over apply_sharded gives the averaged gradient."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    fn = ff.functionalize(m)
    params = ff.shard(fn.params, ff.make_plan(m, ff.layer_policy([nn.Linear])), group)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))

    def loss(shards):
        return ff.apply_sharded(fn, params.replace(shards), fn.buffers, x).square().mean()

    # Reference: plain autograd on the full model, all-reduced by torch and divided by W.
    full = {k: v.detach().requires_grad_() for k, v in fn.params.items()}
    fn(full, fn.buffers, x).square().mean().backward()
    want = {k: v.grad.clone() for k, v in full.items()}
    for t in want.values():
        dist.all_reduce(t, group=group)
    for transform in (torch.func.grad, lambda f: lambda p: torch.func.grad_and_value(f)(p)[0]):
        got = ff.unshard(params.replace(transform(loss)(params.shards)))
        for k, v in want.items():
            torch.testing.assert_close(got[k], v / world)
    return True


def test_grad_through_apply_sharded(pool):
    # Catches: hooks that gather the wrong unit or reduce its gradient into another unit's shard.
    for world in (2, 3):
        assert all(pool.run(_grad_through_apply_sharded, world=world))
