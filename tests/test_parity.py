"""The sharded step equals the unsharded reference, step after step, for W = 1..4."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdp_fn as ff
from tests.helpers import MLP, batch_for, local_part, make, mse_loss, reference_run, rel

STEPS = 5

OPTIMIZERS = {
    "adamw": (
        lambda params: ff.adamw(lr=1e-2, weight_decay=0.1),
        partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
    ),
    "sgd": (lambda params: ff.sgd(lr=0.05, momentum=0.9), partial(torch.optim.SGD, lr=0.05, momentum=0.9)),
    "sgd_dampened": (
        lambda params: ff.sgd(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
        partial(torch.optim.SGD, lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
    ),
    "adam_l2": (
        lambda params: ff.adam(lr=1e-2, weight_decay=0.05),
        partial(torch.optim.Adam, lr=1e-2, weight_decay=0.05),
    ),
    "sgd_nesterov": (
        lambda params: ff.sgd(lr=0.05, momentum=0.9, nesterov=True),
        partial(torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True),
    ),
    "torch_adam": (
        lambda params: ff.from_torch(torch.optim.Adam(list(params.values()), lr=1e-2)),
        partial(torch.optim.Adam, lr=1e-2),
    ),
}


@pytest.mark.parametrize(
    ("make_opt", "bad"),
    [
        (ff.sgd, {"lr": -0.1}),
        (ff.sgd, {"momentum": -0.1}),
        (ff.sgd, {"weight_decay": -0.5}),
        (ff.adamw, {"lr": -0.1}),
        (ff.adamw, {"eps": -1e-8}),
        (ff.adamw, {"weight_decay": -0.5}),
        (ff.adamw, {"betas": (0.9, 1.0)}),
    ],
)
def test_optimizer_hyperparameters_are_checked(make_opt, bad):
    # Catches: a bound moved (a weight decay of -0.5 accepted), as torch.optim refuses them too.
    with pytest.raises(ValueError, match="invalid (SGD|AdamW) hyper-parameters"):
        make_opt(**bad)


def _update_by_hand(group):
    torch.manual_seed(0)
    m = nn.Linear(5, 3)
    params = ff.shard(dict(m.named_parameters()), ff.make_plan(m), group)
    full = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in m.named_parameters()}
    grads = ff.reduce_grads(full, params)  # the same on every rank: the mean is itself
    opt = ff.sgd(lr=0.5)
    updates, _ = opt.update(grads, opt.init(params), params)
    after = ff.unshard(ff.apply_updates(params, updates))
    return max((after[k] - (v.detach() - 0.5 * full[k])).abs().max().item() for k, v in m.named_parameters())


def test_optimizer_on_gradients_from_reduce_grads(pool):
    # Catches: an optimizer that steps only parameters a train step marked as received, so that
    # gradients a user reduced by hand (no mark at all) are silently ignored.
    assert max(pool.run(_update_by_hand, world=2)) < 1e-6


def _large_updates(group, partial_mask: bool):
    """Three ff.adamw steps in place (the train step's fused form) on shards of several
    cache-sized pieces, against torch.optim.AdamW."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(700, 640), nn.Linear(640, 333))  # 448k + 213k elements: pieces of 128k
    plan = ff.make_plan(m)
    params = ff.shard(dict(m.named_parameters()), plan, group)
    names = [k for k, _ in m.named_parameters()]
    used = {k: not partial_mask or k.startswith("0.") for k in names}  # the second layer unused
    gen = torch.Generator().manual_seed(1)
    full = {
        k: torch.randn(v.shape, generator=gen) if used[k] else torch.zeros(v.shape) for k, v in m.named_parameters()
    }
    masks = {u.name: tuple(used[p.name] for p in u.params) for u in plan.units}
    opt = ff.adamw(lr=1e-2, weight_decay=0.1)
    state = opt.init(params)
    for _ in range(3):
        state = ff.update_in_place(opt, ff.reduce_grads(full, params).with_received(masks), state, params)
    ref = copy.deepcopy(m)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        for k, p in ref.named_parameters():
            p.grad = full[k].clone() if used[k] else None
        torch_opt.step()
    after = ff.unshard(params)
    counts = {u.name: state[0].count[u.name].tolist() for u in plan.units}
    return [k for k, p in ref.named_parameters() if not torch.equal(after[k], p.detach())], counts, masks


@pytest.mark.parametrize("partial_mask", [False, True])
def test_adamw_on_large_shards_equals_torch_to_the_bit(pool, partial_mask):
    # Catches: a large shard stepped in pieces whose step count advances once per piece (a wrong
    # bias correction), a piece left out, or a parameter without gradient stepped.
    for differing, counts, masks in pool.run(_large_updates, partial_mask, world=2):
        assert differing == []
        for unit, mask in masks.items():
            assert counts[unit] == [3.0 if got else 0.0 for got in mask]


def _train(group, kind: str, opt_name: str, steps: int = STEPS, step_kw=None, plan_kw=None, **model_kw):
    """Train sharded on this group; on rank 0 also train the reference and return the differences."""
    model, policy, loss_fn = make(kind, **model_kw)
    world, rank = group.size(), group.rank()
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, policy, **(plan_kw or {})), group)
    make_ours, make_ref = OPTIMIZERS[opt_name]
    step = ff.train_step(fn, loss_fn, make_ours(params), schedule=ff.Schedule(**(step_kw or {})))
    state = step.init(params)
    losses, norms = [], []
    for k in range(steps):
        state, metrics = step(state, local_part(batch_for(kind, model, k), rank, world))
        losses.append(metrics["loss"].item())
        norms.append(metrics["grad_norm"].item())
    full = ff.unshard(state.params)
    if rank != 0:
        return None
    ref = reference_run(model, loss_fn, [batch_for(kind, model, k) for k in range(steps)], make_ref)
    return {
        "loss": max(rel(a, b) for a, b in zip(losses, ref["losses"])),
        "grad_norm": max(rel(a, b) for a, b in zip(norms, ref["norms"])),
        "param": max((full[k] - v).abs().max().item() for k, v in ref["params"].items()),
        "update": max((v - model.get_parameter(k)).abs().max().item() for k, v in ref["params"].items()),
        "loss_drop": ref["losses"][0] - ref["losses"][-1],
    }


# A few times the largest difference measured over every parity run here (docs/testing.md,
# `python bench/parity_table.py`): float32 rounding of a different summation order, nothing more.
# Measured maxima: MLP loss 1.2e-7, grad norm 1.1e-7, parameters 4.5e-8; GPT 6.6e-8, 1.4e-7, 1.4e-5.
TOLERANCE = {
    "mlp": {"loss": 5e-7, "grad_norm": 5e-7, "param": 2e-7},
    "gpt": {"loss": 5e-7, "grad_norm": 1e-6, "param": 5e-5},
}


def _check(figures, kind="gpt"):
    """Catches any wrong gradient, scale, chunk or update: each differs by far more than rounding."""
    for what, bound in TOLERANCE[kind].items():
        assert figures[what] <= bound, (what, figures)
    assert figures["param"] < 0.01 * figures["update"], figures  # the parameters moved, and alike
    assert figures["loss_drop"] > 0, figures  # the reference learns: not two models that never move


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_parity_adamw(pool, kind, world):
    _check(pool.run(_train, kind, "adamw", world=world)[0], kind)


@pytest.mark.parametrize("opt_name", ["sgd", "sgd_dampened", "torch_adam"])
def test_parity_other_optimizers(pool, opt_name):
    _check(pool.run(_train, "mlp", opt_name, world=3)[0], "mlp")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("opt_name", ["adam_l2", "sgd_nesterov"])
def test_parity_adam_and_nesterov_equal_torch(pool, opt_name, world):
    # Catches: ff.adam's L2 decay applied after the moments (AdamW's place), Nesterov's look-ahead lost.
    _check(pool.run(_train, "mlp", opt_name, world=world)[0], "mlp")


OPTIONS = {
    "update_in_backward": {"step_kw": {"update_in_backward": True}},
    "keep_gathered": {"step_kw": {"reshard_after_forward": False}},
    "split_root": {"plan_kw": {"split_root": True}},
    "prefetch_post": {"step_kw": {"backward_prefetch": ff.BackwardPrefetch.BACKWARD_POST}},
    "no_prefetch": {"step_kw": {"backward_prefetch": None, "forward_prefetch": False, "max_inflight": 1}},
    "all_three": {
        "step_kw": {"update_in_backward": True, "reshard_after_forward": False},
        "plan_kw": {"split_root": True},
    },
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("world", [2, 3])
def test_parity_memory_options(pool, option, world):
    _check(pool.run(_train, "gpt", "adamw", world=world, **OPTIONS[option])[0])


@pytest.mark.parametrize("opt_name", ["sgd", "sgd_dampened", "torch_adam"])
def test_parity_update_in_backward_other_optimizers(pool, opt_name):
    _check(pool.run(_train, "mlp", opt_name, world=2, **OPTIONS["update_in_backward"])[0], "mlp")


def test_parity_tied_gpt(pool):
    """Embedding and head share one tensor: one shard, gradient summed from both uses."""
    _check(pool.run(_train, "gpt", "adamw", world=3, tie=True)[0])


def _train_hypothesis(group, examples: int):
    world, rank = group.size(), group.rank()

    @given(
        widths=st.lists(st.integers(1, 9), min_size=2, max_size=5),
        wrap=st.sampled_from(["layers", "none", "size"]),
        lr=st.sampled_from([1e-3, 3e-2]),
    )
    def prop(widths, wrap, lr):
        torch.manual_seed(len(widths))
        model = MLP(tuple(widths), act=nn.ReLU)
        policy = {"layers": ff.layer_policy([nn.Linear]), "none": None, "size": ff.size_policy(20)}[wrap]
        fn = ff.functionalize(model)
        params = ff.shard(fn.params, ff.make_plan(model, policy), group)
        step = ff.train_step(fn, mse_loss, ff.adamw(lr=lr))
        state = step.init(params)
        batches = [batch_for("mlp", model, k) for k in range(STEPS)]
        ref = reference_run(model, mse_loss, batches, partial(torch.optim.AdamW, lr=lr))
        for k, b in enumerate(batches):
            state, m = step(state, local_part(b, rank, world))
            # Every compared value is replicated, so every rank fails (and shrinks) alike.
            assert rel(m["loss"].item(), ref["losses"][k]) <= 5e-7
            assert rel(m["grad_norm"].item(), ref["norms"][k]) <= 1e-6 or ref["norms"][k] < 1e-7
        full = ff.unshard(state.params)
        for name, v in ref["params"].items():
            torch.testing.assert_close(full[name], v, atol=5e-7, rtol=0)  # lr up to 3e-2: 3x the MLP bound

    settings(max_examples=examples)(prop)()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_parity_hypothesis_mlps(pool, world):
    assert all(pool.run(_train_hypothesis, 12, world=world))


def _against_fsdp2(group, steps: int = STEPS):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from examples.gpt import lm_loss

    model, policy, loss_fn = make("gpt")
    world, rank = group.size(), group.rank()
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, policy), group)
    step = ff.train_step(fn, loss_fn, ff.adamw(lr=1e-2))
    state = step.init(params)

    peer = copy.deepcopy(model)
    mesh = DeviceMesh.from_group(group, "cpu")
    for block in peer.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(peer, mesh=mesh)
    opt = torch.optim.AdamW(peer.parameters(), lr=1e-2)
    losses, norms = [], []
    for k in range(steps):
        batch = local_part(batch_for("gpt", model, k), rank, world)
        state, metrics = step(state, batch)
        opt.zero_grad()
        loss = lm_loss(peer, batch)
        loss.backward()
        # FSDP2's gradients are DTensors: full_tensor() all-gathers each (torch's collectives).
        theirs_norm = torch.sqrt(sum(p.grad.full_tensor().double().square().sum() for p in peer.parameters()))
        opt.step()
        theirs = loss.detach().clone()
        dist.all_reduce(theirs, group=group)
        losses.append((metrics["loss"].item(), theirs.item() / world))
        norms.append((metrics["grad_norm"].item(), theirs_norm.item()))
    ours = ff.unshard(state.params)
    theirs_params = {k: v.full_tensor() for k, v in peer.named_parameters()}
    return {
        "loss": max(rel(a, b) for a, b in losses),
        "grad_norm": max(rel(a, b) for a, b in norms),
        "param": max((ours[k] - v).abs().max().item() for k, v in theirs_params.items()),
        "update": max((v - model.get_parameter(k)).abs().max().item() for k, v in theirs_params.items()),
        "loss_drop": losses[0][1] - losses[-1][1],
    }


@pytest.mark.parametrize("world", [2, 3])
def test_parity_with_torch_fsdp2(pool, world):
    # Catches: anything in which fsdp_fn and torch's FSDP2 differ: losses, gradient norms, parameters.
    _check(pool.run(_against_fsdp2, world=world)[0])


def _kwargs_forward(group):
    torch.manual_seed(0)
    model = MLP()
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group)
    x = torch.randn(4, 7)
    out = ff.apply_sharded(fn, params, fn.buffers, x, scale=3.0)
    return (out - model(x, scale=3.0)).abs().max().item()


def test_forward_takes_args_and_kwargs(pool):
    assert max(pool.run(_kwargs_forward, world=2)) < 1e-6


def _mesh_and_buffers(group, buffer_sync):
    """A 1-D DeviceMesh as the group; replicated BatchNorm statistics synced after every step.

    In training mode BatchNorm normalises with the batch's statistics, so the parameters never
    depend on the running ones, and the running statistics follow a linear update. So the
    reference is the same training with ``buffer_sync=None``: under "broadcast" every rank ends
    with rank 0's unsynced statistics; under "mean", with the mean of every rank's.
    """
    from torch.distributed.device_mesh import DeviceMesh

    world, rank = group.size(), group.rank()
    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Tanh(), nn.Linear(7, 2))
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([nn.Linear]))
    mine = {k: v + rank for k, v in fn.buffers.items()}  # ranks start out of step on purpose
    finals = {}
    for mode in (buffer_sync, None):
        params = ff.shard(fn.params, plan, mesh)
        assert params.group is mesh.get_group()
        step = ff.train_step(fn, mse_loss, ff.sgd(lr=0.1), buffer_sync=mode)
        state = step.init(params, mine)
        started = torch.equal(state.buffers["1.running_mean"], fn.buffers["1.running_mean"])  # rank 0's
        for k in range(3):
            g = torch.Generator().manual_seed(k)
            x, y = torch.randn(4 * world, 5, generator=g), torch.randn(4 * world, 2, generator=g)
            state, _ = step(state, (x.chunk(world)[rank] * (rank + 1), y.chunk(world)[rank]))
        finals[mode] = state.buffers
    synced, alone = finals[buffer_sync], finals[None]
    stats = {k: v.clone() for k, v in alone.items() if v.is_floating_point()}
    if buffer_sync == "broadcast":
        for v in stats.values():
            dist.broadcast(v, group=group, group_src=0)  # torch's broadcast: rank 0's values
    else:
        for v in stats.values():
            dist.all_reduce(v, group=group)
            v /= world
    return (
        started,
        max((synced[k] - v).abs().max().item() for k, v in stats.items()),
        max((alone[k] - v).abs().max().item() for k, v in stats.items()),  # this rank's own, unsynced
        synced["1.num_batches_tracked"].item(),
    )


@pytest.mark.parametrize("buffer_sync", ["broadcast", "mean"])
def test_device_mesh_group_and_consistent_buffers(pool, buffer_sync):
    # Catches: a broadcast from another rank than 0, a mean that sums without dividing, buffers
    # left unsynced (the ranks' statistics really differ: the last figure).
    results = pool.run(_mesh_and_buffers, buffer_sync, world=3)
    for started_equal, error, _, tracked in results:
        assert started_equal  # init broadcasts from rank 0
        assert error < 1e-6
        assert tracked == 3
    assert max(spread for _, _, spread, _ in results) > 1e-2


def _donate_false_leaves_input_intact(group):
    rank = group.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Tanh(), nn.Linear(7, 2))
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group)
    step = ff.train_step(fn, mse_loss, ff.adamw(lr=0.1), donate=False)
    state = step.init(params)
    before = [t.clone() for t in ff.tree_leaves((state.params, state.opt_state, state.buffers))]
    g = torch.Generator().manual_seed(rank)
    new, _ = step(state, (torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)))
    after = ff.tree_leaves((state.params, state.opt_state, state.buffers))
    moved = ff.tree_leaves((new.params, new.buffers))
    intact = all(torch.equal(a, b) for a, b in zip(before, after))
    return (
        intact,
        not torch.equal(moved[0], after[0]),
        not torch.equal(new.buffers["1.running_mean"], state.buffers["1.running_mean"]),
    )


def test_donate_false_leaves_the_input_state_intact(pool):
    for intact, params_moved, buffers_moved in pool.run(_donate_false_leaves_input_intact, world=2):
        assert intact
        assert params_moved
        assert buffers_moved
