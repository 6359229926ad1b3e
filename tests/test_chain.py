"""Gradient transformations that chain: each equals applying its piece by hand, on real ranks."""

from __future__ import annotations

import copy
import math
from functools import partial

import pytest
import torch
from torch import nn

import fsdp_fn as ff
from tests.helpers import MLP, batch_for, local_part, mse_loss, reference_run, rel

IN_BACKWARD = ff.Schedule(update_in_backward=True)


def _setup(group, optimizer, **schedule):
    torch.manual_seed(0)
    model = MLP()
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([nn.Linear]))
    step = ff.train_step(fn, mse_loss, optimizer, schedule=ff.Schedule(**schedule))
    return model, fn, plan, step, step.init(ff.shard(fn.params, plan, group))


def _clip_chain(group, max_norm):
    """chain(clip_by_global_norm, adamw) against torch's clip_grad_norm_ + AdamW, one process."""
    world, rank = group.size(), group.rank()
    model, fn, plan, step, state = _setup(group, ff.chain(ff.clip_by_global_norm(max_norm), ff.adamw(lr=1e-2)))
    norms = []
    for k in range(3):
        state, metrics = step(state, local_part(batch_for("mlp", model, k), rank, world))
        norms.append(metrics["grad_norm"].item())
    full = ff.unshard(state.params)
    batches = [batch_for("mlp", model, k) for k in range(3)]
    ref = reference_run(model, mse_loss, batches, partial(torch.optim.AdamW, lr=1e-2), clip=max_norm)
    return (
        max(rel(a, b) for a, b in zip(norms, ref["norms"])),
        max((full[k] - v).abs().max().item() for k, v in ref["params"].items()),
        min(ref["norms"]),
        max(ref["norms"]),
    )


@pytest.mark.parametrize("max_norm", [0.05, 100.0], ids=["clipping", "below_max_norm"])
def test_clip_by_global_norm_in_a_chain_equals_torch(pool, max_norm):
    for norm, param, smallest, largest in pool.run(_clip_chain, max_norm, world=3):
        # both regimes really happen: every norm above 0.05, every norm below 100, so a
        # clip that scaled small gradients up (no clamp at 1) or never clipped would fail
        assert (smallest > max_norm) if max_norm < 1 else (largest < max_norm)
        assert norm < 1e-5
        assert param < 1e-6


def _by_hand(group):
    """The composite equals its pieces applied by hand to value_and_grad's gradients."""
    world, rank = group.size(), group.rank()
    model, fn, plan, _, state = _setup(group, ff.adamw())
    batch = local_part(batch_for("mlp", model, 0), rank, world)
    _, grads = ff.value_and_grad(fn, mse_loss)(state.params, fn.buffers, batch)
    composite = ff.chain(ff.clip_by_global_norm(0.01), ff.sgd(lr=0.1))
    updates, _ = composite.update(grads, composite.init(state.params), state.params)
    params_a = ff.apply_updates(state.params, updates)
    # by hand: the global norm, the clip coefficient, then plain SGD
    square = torch.tensor(sum(g.double().square().sum().item() for g in grads.values()), dtype=torch.float64)
    torch.distributed.all_reduce(square, group=group)
    coef = min(1.0, 0.01 / (square.sqrt().item() + 1e-6))
    params_b = {u: state.params[u] - 0.1 * coef * grads[u] for u in grads}
    return max((params_a[u] - params_b[u]).abs().max().item() for u in grads)


def test_chain_equals_its_pieces_by_hand(pool):
    assert max(pool.run(_by_hand, world=2)) < 1e-6


def _finite(group):
    rank = group.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 1))
    fn = ff.functionalize(model)
    step = ff.train_step(fn, mse_loss, ff.apply_if_finite(ff.adamw()))
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group))
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    bad = x.clone()
    if rank == 1:
        bad[0, 0] = float("nan")  # one rank's data is bad: every rank skips
    before = ff.unshard(state.params), {k: v.clone() for k, v in state.buffers.items()}
    counts = []  # (notfinite_count, last_finite, total_notfinite) after each step
    state, m1 = step(state, (bad, y))
    counts.append(state.opt_state[:3])
    after = ff.unshard(state.params)
    state, _ = step(state, (bad, y))
    counts.append(state.opt_state[:3])
    state, m2 = step(state, (x, y))
    counts.append(state.opt_state[:3])
    moved = ff.unshard(state.params)
    return (
        bool(m1["skipped"]),
        all(torch.equal(before[0][k], after[k]) for k in after),
        all(torch.equal(before[1][k], state.buffers[k]) or k.endswith("num_batches_tracked") for k in before[1]),
        counts,
        bool(m2["skipped"]),
        any(not torch.equal(after[k], moved[k]) for k in after),
    )


def test_apply_if_finite_skips_on_every_rank_and_then_applies(pool):
    # Catches: a skip on one rank only, and the count of non-finite steps in a row not
    # starting again after an applied step.
    for skipped, untouched, _, counts, skipped2, moved in pool.run(_finite, world=3):
        assert skipped and untouched
        assert counts == [(1, False, 1), (2, False, 2), (0, True, 2)]
        assert not skipped2 and moved


def _infinite(group):
    """``apply_if_finite`` on hand-made sharded gradients holding +inf, -inf or both (no NaN),
    each on one rank's shard only: through ``update`` and ``update_in_place``."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    params = ff.shard(dict(m.named_parameters()), ff.make_plan(m, ff.layer_policy([nn.Linear])), group)
    opt = ff.apply_if_finite(ff.adamw(lr=1e-2))
    out = {}
    for label, bad in (
        ("+inf", {"1.bias": (2, math.inf)}),  # the last unit's last elements: the last rank's shard
        ("-inf", {"0.weight": (0, -math.inf)}),  # the first element: rank 0's shard
        ("both", {"1.bias": (2, math.inf), "0.weight": (0, -math.inf)}),
    ):
        full = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(7)) for k, v in m.named_parameters()}
        for name, (i, value) in bad.items():
            full[name].view(-1)[i] = value
        grads = ff.reduce_grads(full, params)
        here = bool(any(t.isinf().any() for t in grads.values()))  # this rank's shards hold an inf
        nan = bool(any(t.isnan().any() for t in grads.values()))
        state = opt.init(params)
        updates, new = opt.update(grads, state, params)
        same_state = all(
            torch.equal(a, b)
            for a, b in zip(ff.tree_leaves(state.inner_state), ff.tree_leaves(new.inner_state), strict=True)
            if isinstance(a, torch.Tensor)
        )
        zero = all(not t.any() for t in updates.values())
        in_place = ff.tree_map(torch.clone, params)
        state_ip = opt.init(in_place)
        before = [t.clone() for t in ff.tree_leaves(state_ip.inner_state) if isinstance(t, torch.Tensor)]
        state_ip = ff.update_in_place(opt, ff.reduce_grads(full, params), state_ip, in_place)
        after = [t for t in ff.tree_leaves(state_ip.inner_state) if isinstance(t, torch.Tensor)]
        unmoved = all(torch.equal(in_place[u], params[u]) for u in params.plan.unit_names)
        out[label] = (
            here,
            nan,
            zero and same_state,
            tuple(new[:3]),
            opt.outcome(new).name,
            unmoved and all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
            tuple(state_ip[:3]),
        )
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_apply_if_finite_rejects_infinite_gradients_on_every_rank(pool, world):
    # Catches (issue 42.12): a finiteness check that treats only NaN as non-finite (an inf loss gives
    # NaN gradients, so no other test fed an inf): +inf, -inf or both, on one rank's shard only.
    results = pool.run(_infinite, world=world)
    for label in ("+inf", "-inf", "both"):
        assert any(r[label][0] for r in results), label  # some rank holds it
        for r in results:
            here, nan, rejected, counters, outcome, rejected_ip, counters_ip = r[label]
            assert not nan, label  # infinities, not NaN
            assert rejected and rejected_ip, label  # zero updates, the inner state (and params) as they were
            assert counters == counters_ip == (1, False, 1), (label, counters, counters_ip)
            assert outcome == "REJECTED", label


def _accumulated(group, every):
    world, rank = group.size(), group.rank()
    model, fn, plan, step, state = _setup(group, ff.accumulate(every, ff.adamw(lr=1e-2)))
    big = batch_for("mlp", model, 0, size=12)
    mine = local_part(big, rank, world)
    first = ff.unshard(state.params)
    for i in range(every):  # the same examples over `every` calls
        state, _ = step(state, local_part(mine, i, every))
        if i < every - 1:
            unchanged = all(torch.equal(first[k], v) for k, v in ff.unshard(state.params).items())
    ref = reference_run(model, mse_loss, [big], partial(torch.optim.AdamW, lr=1e-2))
    full = ff.unshard(state.params)
    return unchanged, max((full[k] - v).abs().max().item() for k, v in ref["params"].items())


def test_accumulate_equals_one_big_batch(pool):
    for unchanged, param in pool.run(_accumulated, 2, world=2):
        assert unchanged  # the first call only sums
        assert param < 1e-6


def test_update_in_backward_names_the_links_that_need_the_whole_gradient():
    torch.manual_seed(0)
    model = MLP()
    fn = ff.functionalize(model)
    with pytest.raises(ValueError, match=r"cannot be combined with clip_by_global_norm\(1\)"):
        ff.train_step(fn, mse_loss, ff.chain(ff.clip_by_global_norm(1.0), ff.adamw()), schedule=IN_BACKWARD)
    with pytest.raises(ValueError, match=r"apply_if_finite, accumulate\(2\)"):
        ff.train_step(fn, mse_loss, ff.apply_if_finite(ff.accumulate(2, ff.adamw())), schedule=IN_BACKWARD)
    with pytest.raises(ValueError, match=r"cannot be combined with donate=False$"):
        ff.train_step(fn, mse_loss, ff.adamw(), schedule=IN_BACKWARD, donate=False)
    ff.train_step(fn, mse_loss, ff.chain(ff.adamw()), schedule=IN_BACKWARD)  # an elementwise chain is fine
    with pytest.raises(TypeError, match="chain takes GradientTransformations"):
        ff.chain(ff.clip_by_global_norm(1.0), torch.optim.SGD)


def test_the_schedule_is_the_one_value_for_when_things_happen():
    torch.manual_seed(0)
    model = MLP()
    fn = ff.functionalize(model)
    mp = ff.MixedPrecision(param_dtype=torch.bfloat16)
    schedule = ff.Schedule(max_inflight=3, mixed_precision=mp, micro_batches=2)
    assert ff.train_step(fn, mse_loss, ff.adamw(), schedule=schedule).schedule is schedule
    assert ff.train_step(fn, mse_loss, ff.adamw()).schedule == ff.Schedule()
    # The gather policy, clipping and accumulation are not options of the step any more.
    for removed in ("max_inflight", "mixed_precision", "update_in_backward", "clip_grad_norm", "accumulation"):
        with pytest.raises(TypeError, match=removed):
            ff.train_step(fn, mse_loss, ff.adamw(), **{removed: 1})


def _no_decay(name, shape):
    return len(shape) >= 2  # weights decay; biases do not


def _masked_decay(group, optimizer, update_in_backward):
    """Weight decay on the weights only, against torch's two parameter groups."""
    world, rank = group.size(), group.rank()
    ours = {
        "adamw": ff.adamw(lr=1e-2, weight_decay=0.5, weight_decay_mask=_no_decay),
        "sgd": ff.sgd(lr=0.1, momentum=0.9, weight_decay=0.5, weight_decay_mask=_no_decay),
    }[optimizer]
    schedule = {"update_in_backward": True} if update_in_backward else {}
    model, fn, plan, step, state = _setup(group, ours, **schedule)
    for k in range(3):
        state, _ = step(state, local_part(batch_for("mlp", model, k), rank, world))
    return ff.unshard(state.params)


@pytest.mark.parametrize("update_in_backward", [False, True], ids=["default", "update_in_backward"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("world", [1, 3])
def test_weight_decay_mask_equals_torch_parameter_groups(pool, world, optimizer, update_in_backward):
    # Catches: decay applied to a masked parameter, a unit stepped whole although its
    # parameters differ in decay, a decay group's slices out of step with their moments.
    torch.manual_seed(0)
    model = MLP()
    batches = [batch_for("mlp", model, k) for k in range(3)]
    kw = {"adamw": {"lr": 1e-2}, "sgd": {"lr": 0.1, "momentum": 0.9}}[optimizer]
    make = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]

    def param_groups(params):
        named = dict(zip([n for n, _ in model.named_parameters()], params, strict=True))
        decayed = [p for n, p in named.items() if _no_decay(n, tuple(p.shape))]
        plain = [p for n, p in named.items() if not _no_decay(n, tuple(p.shape))]
        return make([{"params": decayed, "weight_decay": 0.5}, {"params": plain, "weight_decay": 0.0}], **kw)

    ref = reference_run(model, mse_loss, batches, param_groups)
    undecayed = reference_run(model, mse_loss, batches, partial(make, weight_decay=0.5, **kw))
    # the mask matters here: decaying every parameter moves the biases measurably
    assert max((ref["params"][k] - undecayed["params"][k]).abs().max().item() for k in ref["params"]) > 1e-4
    for full in pool.run(_masked_decay, optimizer, update_in_backward, world=world):
        for name, p in ref["params"].items():
            torch.testing.assert_close(full[name], p, rtol=1e-5, atol=1e-6)


def _warmup_cosine(k: int) -> float:
    return min(1.0, (k + 1) / 2) * 0.5 * (1 + math.cos(math.pi * min(k, 4) / 4))


def _sharded_mlp(group):
    torch.manual_seed(0)
    model = MLP()
    fn = ff.functionalize(model)
    return model, fn, ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group)


def _scheduled(group):
    """A learning-rate schedule: torch's own scheduler on a from_torch optimizer, stepped after each step."""
    world, rank = group.size(), group.rank()
    model, fn, params = _sharded_mlp(group)
    opt = torch.optim.AdamW(list(params.values()), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine)
    step = ff.train_step(fn, mse_loss, ff.from_torch(opt))
    state = step.init(params)
    for k in range(5):
        state, _ = step(state, local_part(batch_for("mlp", model, k), rank, world))
        scheduler.step()
    return ff.unshard(state.params)


def _torch_scheduled(make, batches=None):
    """One process: ``make(params)``'s optimizer with ``LambdaLR(_warmup_cosine)`` stepped after each step."""
    torch.manual_seed(0)
    model = MLP()
    batches = batches(model) if batches is not None else [batch_for("mlp", model, k) for k in range(5)]
    schedulers = []

    def scheduled(params):
        opt = make(params)
        schedulers.append(torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine))
        return opt

    return model, batches, reference_run(model, mse_loss, batches, scheduled, after_step=lambda: schedulers[0].step())


def test_a_torch_lr_scheduler_drives_a_from_torch_optimizer(pool):
    model, batches, ref = _torch_scheduled(partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1))
    constant = reference_run(model, mse_loss, batches, partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1))
    assert max((ref["params"][k] - constant["params"][k]).abs().max().item() for k in ref["params"]) > 1e-3
    for full in pool.run(_scheduled, world=2):
        for name, p in ref["params"].items():
            torch.testing.assert_close(full[name], p, rtol=1e-5, atol=1e-6)


def _scheduled_ours(group, optimizer, how):
    """``adamw``/``sgd`` with ``lr`` a schedule of the steps applied before this one."""
    world, rank = group.size(), group.rank()
    ours = {
        "adamw": ff.adamw(lr=lambda k: 1e-2 * _warmup_cosine(k), weight_decay=0.1),
        "sgd": ff.sgd(lr=lambda k: 0.1 * _warmup_cosine(k), momentum=0.9),
    }[optimizer]
    if how == "accumulate":
        ours = ff.accumulate(2, ours)
    elif how == "clip":
        ours = ff.chain(ff.clip_by_global_norm(1e9), ours)
    schedule = {"update_in_backward": True} if how == "update_in_backward" else {}
    model, fn, plan, step, state = _setup(group, ours, **schedule)
    calls = 10 if how == "accumulate" else 5
    for k in range(calls):
        state, _ = step(state, local_part(batch_for("mlp", model, k), rank, world))
    return ff.unshard(state.params)


@pytest.mark.parametrize("how", ["plain", "update_in_backward", "clip", "accumulate"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_learning_rate_schedule_equals_torchs_lambda_lr(pool, optimizer, how):
    # Catches: the schedule read at the wrong step (off by one, per unit under
    # update_in_backward, per call under accumulate) or lost by a link of the chain.
    make = {
        "adamw": partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
        "sgd": partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    }[optimizer]

    def pairs(model):  # two calls' mean gradient per step: the same as their two batches at once
        return [
            torch.utils._pytree.tree_map(
                lambda a, b: torch.cat([a, b]), batch_for("mlp", model, 2 * k), batch_for("mlp", model, 2 * k + 1)
            )
            for k in range(5)
        ]

    _, _, ref = _torch_scheduled(make, pairs if how == "accumulate" else None)
    for full in pool.run(_scheduled_ours, optimizer, how, world=2):
        for name, p in ref["params"].items():
            torch.testing.assert_close(full[name], p, rtol=1e-5, atol=1e-6)


def _own_loop(group):
    """value_and_grad, then ``update`` and ``apply_updates`` by hand, as with optax: the
    schedule reads the count the state keeps, and ``update`` changes nothing it is given."""
    world, rank = group.size(), group.rank()
    model, fn, params = _sharded_mlp(group)
    opt = ff.adamw(lr=lambda k: 1e-2 * _warmup_cosine(k), weight_decay=0.1)
    opt_state = opt.init(params)
    grad_fn = ff.value_and_grad(fn, mse_loss)
    untouched = []
    for k in range(5):
        _, grads = grad_fn(params, fn.buffers, local_part(batch_for("mlp", model, k), rank, world))
        before = [t.clone() for t in ff.tree_leaves((grads, opt_state, params)) if isinstance(t, torch.Tensor)]
        updates, new_state = opt.update(grads, opt_state, params)
        after = [t for t in ff.tree_leaves((grads, opt_state, params)) if isinstance(t, torch.Tensor)]
        untouched.append(all(torch.equal(a, b) for a, b in zip(before, after, strict=True)))
        params, opt_state = ff.apply_updates(params, updates), new_state
    messages = []
    for bad in (-1e-3, float("nan"), "0.1", torch.ones(2)):  # a schedule gone wrong: refused, nothing applied
        wrong = ff.adamw(lr=lambda k, bad=bad: bad)
        try:
            wrong.update(grads, wrong.init(params), params)
        except (ValueError, TypeError) as e:
            messages.append(f"{type(e).__name__}: {e}")
    return untouched, opt_state[-1].count, messages, ff.unshard(params)


def test_a_schedule_in_a_loop_of_ones_own_reads_the_count_in_its_state(pool):
    # Catches: a schedule that needs the caller to set a step (grads.step before), an update that
    # changes its inputs in place, a schedule's bad value or type accepted.
    _, _, ref = _torch_scheduled(partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1))
    for untouched, count, messages, full in pool.run(_own_loop, world=2):
        assert untouched == [True] * 5 and count == 5
        assert messages == [
            f"ValueError: scale_by_learning_rate: the schedule gave lr={bad} at count 0; a learning rate must be a "
            "finite number >= 0 (nothing was applied)"
            for bad in (-0.001, "nan")
        ] + [
            f"TypeError: scale_by_learning_rate: the schedule returned a {kind} at count 0; a learning rate is a "
            "number: a Python float or a 0-d tensor or array (torch, numpy, jax)"
            for kind in ("str", "Tensor of shape (2,)")
        ]
        for name, p in ref["params"].items():
            torch.testing.assert_close(full[name], p, rtol=1e-5, atol=1e-6)


def _with_aux(group):
    """``has_aux``: the loss returns (loss, {predictions, accuracy}); the step and value_and_grad
    hand the aux back, detached, and train exactly as the loss alone does."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = MLP()
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([nn.Linear]))
    x, y = local_part(batch_for("mlp", model, 0), rank, world)

    def with_aux(m, batch):
        out = m(batch[0])
        return mse_loss(lambda _: out, batch), {
            "out": out,
            "sign_agrees": (out.sign() == batch[1].sign()).float().mean(),
        }

    want = model(x).detach()  # the predictions at the initial parameters
    results = {}
    step = ff.train_step(fn, with_aux, ff.adamw(lr=1e-2), has_aux=True)
    plain = ff.train_step(fn, mse_loss, ff.adamw(lr=1e-2))
    state, metrics = step(step.init(ff.shard(fn.params, plan, group)), (x, y))
    ref_state, ref_metrics = plain(plain.init(ff.shard(fn.params, plan, group)), (x, y))
    aux = metrics["aux"]
    results["step"] = (
        (aux["out"] - want).abs().max().item(),
        aux["out"].requires_grad,
        float(metrics["loss"]) == float(ref_metrics["loss"]),
        all(torch.equal(a, b) for a, b in zip(state.params.values(), ref_state.params.values(), strict=True)),
    )
    micro = ff.train_step(fn, with_aux, ff.adamw(), has_aux=True, schedule=ff.Schedule(micro_batches=2))
    _, metrics = micro(micro.init(ff.shard(fn.params, plan, group)), [(x[:2], y[:2]), (x[2:], y[2:])])
    results["micro"] = [tuple(a["out"].shape) for a in metrics["aux"]]
    params = ff.shard(fn.params, plan, group)
    (loss, aux), grads = ff.value_and_grad(fn, with_aux, has_aux=True)(params, fn.buffers, (x, y))
    _, want_grads = ff.value_and_grad(fn, mse_loss)(params, fn.buffers, (x, y))
    leaves = params.replace({k: v.detach().requires_grad_() for k, v in params.shards.items()})  # composable path
    (_, aux_c), grads_c = ff.value_and_grad(fn, with_aux, has_aux=True)(leaves, fn.buffers, (x, y))
    results["value_and_grad"] = (
        (aux["out"] - want).abs().max().item(),
        (aux_c["out"] - want).abs().max().item(),
        max((grads[u] - want_grads[u]).abs().max().item() for u in plan.unit_names),
        max((grads_c[u] - want_grads[u]).abs().max().item() for u in plan.unit_names),
    )
    try:
        ff.value_and_grad(fn, mse_loss, has_aux=True)(params, fn.buffers, (x, y))
    except TypeError as e:
        results["error"] = str(e)
    return results


def test_has_aux_returns_this_ranks_aux_and_trains_as_the_loss_alone(pool):
    for r in pool.run(_with_aux, world=2):
        diff, requires_grad, same_loss, same_params = r["step"]
        assert diff < 1e-6 and not requires_grad and same_loss and same_params, r["step"]
        assert r["micro"] == [(2, 3), (4, 3)], r["micro"]  # one aux per micro-batch (6 local examples)
        assert max(r["value_and_grad"]) < 1e-6, r["value_and_grad"]
        assert r["error"] == "has_aux=True: loss_fn must return a pair (loss, aux), got Tensor"


# --- the wrong results of issue 33, each against torch or optax ---------------------------


class _TwoHeads(nn.Module):
    """A trunk and two heads; the loss reaches head ``a`` only, so ``b`` gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(7, 5), nn.Linear(5, 3), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(torch.tanh(self.trunk(x)))


def _times_ten() -> ff.GradientTransformation:
    """A user's own transformation, written with ff.tree_map, as a JAX user would."""
    return ff.GradientTransformation(
        lambda params: (), lambda grads, state, params=None: (ff.tree_map(lambda g: 10 * g, grads), state)
    )


def _user_link_then_clip(group):
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = _TwoHeads()
    fn = ff.functionalize(model)
    opt = ff.chain(_times_ten(), ff.clip_by_global_norm(1.0), ff.adamw(lr=1e-2, weight_decay=0.1))
    step = ff.train_step(fn, mse_loss, opt)
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group))
    for k in range(3):
        state, _ = step(state, local_part(batch_for("mlp", MLP(), k), rank, world))
    return ff.unshard(state.params)


def test_a_clip_after_another_link_norms_what_it_receives_and_unreached_parameters_stay(pool):
    # Catches (issue 33): the clip used the norm from before the link ahead of it (an update 10x
    # too small here), and a link written with ff.tree_map dropped which parameters got a
    # gradient, so AdamW decayed head b, which no loss reached.
    torch.manual_seed(0)
    model = _TwoHeads()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for k in range(3):
        mse_loss(ref, batch_for("mlp", MLP(), k)).backward()
        for p in ref.parameters():
            if p.grad is not None:
                p.grad.mul_(10)
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert ref.b.weight.grad is None and torch.equal(ref.b.weight, model.b.weight)
    for full in pool.run(_user_link_then_clip, world=2):
        for name, p in ref.named_parameters():
            torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def _rejected_round(group):
    world, rank = group.size(), group.rank()
    opt = ff.accumulate(2, ff.apply_if_finite(ff.adamw(lr=lambda k: 1e-2 * _warmup_cosine(k), weight_decay=0.1)))
    model, fn, plan, step, state = _setup(group, opt)
    steps = []
    for k in range(6):
        x, y = local_part(batch_for("mlp", model, k), rank, world)
        if k == 1 and rank == 0:
            x = x.clone()
            x[0, 0] = float("nan")  # one rank's data is bad: the round is rejected on every rank
        state, _ = step(state, (x, y))
        steps.append(state.step)
    return steps, ff.unshard(state.params)


def test_a_schedule_after_a_rejected_round_and_the_step_count(pool):
    # Catches (issue 33): the schedule read grads.step // k, which counted the rejected round
    # (steps 1, 2 where AdamW applied 0, 1); TrainState.step moved on calls mid-round.
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine)
    for a, b in ((2, 3), (4, 5)):  # the first round (calls 0, 1) is rejected
        both = torch.utils._pytree.tree_map(
            lambda s, t: torch.cat([s, t]), batch_for("mlp", model, a), batch_for("mlp", model, b)
        )
        mse_loss(ref, both).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        scheduler.step()
    for steps, full in pool.run(_rejected_round, world=2):
        assert steps == [0, 0, 0, 1, 1, 2]  # rounds applied, not calls
        for name, p in ref.named_parameters():
            torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def _clip_grad_norm(group):
    world, rank = group.size(), group.rank()
    model, fn, params = _sharded_mlp(group)
    _, grads = ff.value_and_grad(fn, mse_loss)(params, fn.buffers, local_part(batch_for("mlp", model, 0), rank, world))
    with ff.comm_log() as log:
        norm = ff.clip_grad_norm_(grads, 0.05)
    return [c.op for c in log.records], float(norm), ff.unshard(grads, frozen=False)


def test_clip_grad_norm_does_one_all_reduce_and_equals_torch(pool):
    # Catches (issue 33): the norm computed twice (two all-reduces, not the documented one).
    torch.manual_seed(0)
    model = MLP()
    mse_loss(model, batch_for("mlp", model, 0)).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
    for ops, norm, clipped in pool.run(_clip_grad_norm, world=2):
        assert ops == ["all_reduce"]
        assert norm == pytest.approx(want, rel=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(clipped[name], p.grad, rtol=1e-5, atol=1e-7)


def _key(c):
    return (c.op, c.unit, c.numel, c.dtype)


def _predicted(group):
    from collections import Counter

    world, rank = group.size(), group.rank()
    opt = ff.apply_if_finite(ff.chain(ff.clip_by_global_norm(1.0), ff.adamw()))
    model, fn, plan, step, state = _setup(group, opt)
    out = []
    for k in range(2):
        with ff.comm_log() as log:
            state, _ = step(state, local_part(batch_for("mlp", model, k), rank, world))
        predicted = ff.predict_collectives(plan, world, ff.Schedule(), first_step=k == 0, optimizer=opt)
        norms = [_key(c) for c in log.records if c.op == "all_reduce"]
        out.append((Counter(map(_key, log.records)) == Counter(map(_key, predicted)), norms))
    return out


def test_the_optimizers_global_norms_are_predicted(pool):
    # Catches: a norm computed twice (or taken from elsewhere) in the step, a prediction that leaves
    # the optimizer's collectives out.
    for steps in pool.run(_predicted, world=2):
        for same, norms in steps:
            assert same
            assert norms == [("all_reduce", None, 1, torch.float64)] * 2  # apply_if_finite's, the clip's


def _kept_input(group):
    world, rank = group.size(), group.rank()
    opt = ff.apply_if_finite(ff.accumulate(2, ff.adamw(lr=lambda k: 1e-2 / (k + 1))))
    torch.manual_seed(0)
    model = MLP()
    fn = ff.functionalize(model)
    step = ff.train_step(fn, mse_loss, opt, donate=False)
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group))
    first = state
    before = [t.clone() for t in ff.tree_leaves(state.opt_state) if isinstance(t, torch.Tensor)]
    for k in range(4):
        state, _ = step(state, local_part(batch_for("mlp", model, k), rank, world))
    after = [t for t in ff.tree_leaves(first.opt_state) if isinstance(t, torch.Tensor)]
    return all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), state.step, state.opt_state[-1][1]


def test_donate_false_keeps_a_wrapped_state_with_counts(pool):
    # Catches: donate=False cloning a state with plain counts (an int has no clone), or changing it.
    for intact, applied, rounds in pool.run(_kept_input, world=2):
        assert intact and applied == 2 and rounds == 2


def _partial_unit_by_hand(group, optimizer):
    """One unit holding head ``b``, which no loss reaches: ``update`` + ``apply_updates`` and the
    step's in-place form, each from its own start."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = _TwoHeads()
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model), group)  # one unit: b's parameters share it
    opt = {
        "adamw": ff.adamw(lr=1e-2, weight_decay=0.1),
        "adam": ff.adam(lr=1e-2, weight_decay=0.1),
        "sgd": ff.sgd(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
    }[optimizer]
    in_place = ff.tree_map(torch.clone, params)
    state, state_ip = opt.init(params), opt.init(in_place)
    grad_fn = ff.value_and_grad(fn, mse_loss)
    for k in range(3):
        batch = local_part(batch_for("mlp", MLP(), k), rank, world)
        _, grads = grad_fn(params, fn.buffers, batch)
        assert not all(grads.received[""])
        updates, state = opt.update(grads, state, params)
        params = ff.apply_updates(params, updates)
        _, grads = grad_fn(in_place, fn.buffers, batch)
        state_ip = ff.update_in_place(opt, grads, state_ip, in_place)
    return ff.unshard(params), ff.unshard(in_place)


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
def test_update_by_hand_skips_unreached_parameters_of_a_unit_as_torch(pool, optimizer):
    # Catches: the functional form stepping (or decaying) the parameters of a unit no loss reached,
    # a per-parameter count or momentum's first step lost in an element mask.
    torch.manual_seed(0)
    ref = _TwoHeads()
    opt = {
        "adamw": torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1),
        "adam": torch.optim.Adam(ref.parameters(), lr=1e-2, weight_decay=0.1),
        "sgd": torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
    }[optimizer]
    for k in range(3):
        mse_loss(ref, batch_for("mlp", MLP(), k)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for functional, fused in pool.run(_partial_unit_by_hand, optimizer, world=2):
        for name, p in ref.named_parameters():
            torch.testing.assert_close(functional[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(fused[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def _value_and_grad_over_micro_batches(group):
    """``value_and_grad(..., schedule=Schedule(micro_batches=2))`` takes a list of two
    micro-batches and returns their mean loss and mean gradient, as the train step does: on
    equal halves, the whole batch's. Before, the list went to ``loss_fn`` whole."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = MLP()
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group)
    x, y = local_part(batch_for("mlp", model, 0), rank, world)
    micro = [(x[:3], y[:3]), (x[3:], y[3:])]
    loss, grads = ff.value_and_grad(fn, mse_loss)(params, fn.buffers, (x, y))
    leaves = params.replace({k: v.detach().requires_grad_() for k, v in params.shards.items()})  # composable path
    diffs = {}
    for name, each, p in (("reduce_each", True, params), ("reduce_once", False, params), ("composable", True, leaves)):
        schedule = ff.Schedule(micro_batches=2, reduce_each_micro_batch=each)
        got_loss, got = ff.value_and_grad(fn, mse_loss, schedule=schedule)(p, fn.buffers, micro)
        diffs[name] = (
            abs(float(got_loss.detach()) - float(loss)),
            max((got[u] - grads[u]).abs().max().item() for u in grads.plan.unit_names),
            got.received == grads.received or p is leaves,  # (the composable path marks none)
        )

    def with_aux(m, batch):
        out = m(batch[0])
        return mse_loss(lambda _: out, batch), out.shape[0]

    (_, aux), _ = ff.value_and_grad(fn, with_aux, schedule=ff.Schedule(micro_batches=2), has_aux=True)(
        params, fn.buffers, micro
    )
    try:
        ff.value_and_grad(fn, mse_loss, schedule=ff.Schedule(micro_batches=2))(params, fn.buffers, (x, y))
        error = "no error"
    except ValueError as e:
        error = str(e)
    return diffs, aux, error


def test_value_and_grad_takes_micro_batches_as_the_step_does(pool):
    for diffs, aux, error in pool.run(_value_and_grad_over_micro_batches, world=2):
        for name, (loss, grad, received) in diffs.items():
            assert loss < 1e-6 and grad < 1e-6 and received, (name, diffs[name])
        assert aux == [3, 3]  # one aux per micro-batch
        assert error.startswith("with Schedule(micro_batches=2) the batch must be a list of 2 micro-batches, got a")


def _empty_chain_in_place(group):
    """chain() is the identity: the train step (update_in_place) adds the gradients, as
    update + apply_updates does (before, in place it applied nothing)."""
    model, fn, plan, step, state = _setup(group, ff.chain())
    batch = local_part(batch_for("mlp", model, 0), group.rank(), group.size())
    before = {k: state.params[k].clone() for k in state.params}
    _, grads = ff.value_and_grad(fn, mse_loss)(state.params, fn.buffers, batch)
    by_hand = ff.apply_updates(state.params, ff.chain().update(grads, (), state.params)[0])
    state, _ = step(state, batch)
    moved = max((state.params[k] - before[k]).abs().max().item() for k in before)
    return moved, max((state.params[k] - by_hand[k]).abs().max().item() for k in before)


def test_an_empty_chain_applies_the_gradients_in_place_too(pool):
    for moved, off in pool.run(_empty_chain_in_place, world=2):
        assert moved > 1e-3
        assert off < 1e-7


# --- issue 42.11: norm_type, as torch's clip_grad_norm_ ----------------------------------------

NORM_TYPES = [1.0, 2.0, math.inf, 3.0]


def _norm_types(group, replicas=1):
    """``clip_grad_norm_`` and ``clip_by_global_norm`` (``update`` and ``update_donated``) with each
    ``norm_type``, against torch's ``clip_grad_norm_`` on the unsharded gradients (one process);
    ``replicas``: hybrid sharding over the pool's 4 ranks (2 shards x 2 replicas)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))  # uneven shards at W=2 and 3
    plan = ff.make_plan(m, ff.layer_policy([nn.Linear]))
    if replicas > 1:
        from fsdp_fn.testing import LayoutSpec

        group = LayoutSpec(4, replicas).group()
    params = ff.shard(dict(m.named_parameters()), plan, group)
    world = params.layout.world
    full = {
        k: torch.randn(v.shape, generator=torch.Generator().manual_seed(5 + i))
        for i, (k, v) in enumerate(m.named_parameters())
    }
    full["1.bias"][2] = -4.0  # the largest |x|, on the last rank's shard
    out = {}
    for p in NORM_TYPES:
        holders = [nn.Parameter(torch.zeros_like(t)) for t in full.values()]
        for h, t in zip(holders, full.values(), strict=True):
            h.grad = t.clone()
        want_norm = float(torch.nn.utils.clip_grad_norm_(holders, 0.5, norm_type=p))
        want = {k: h.grad for k, h in zip(full, holders, strict=True)}
        grads = ff.reduce_grads(full, params)
        with ff.comm_log() as log:
            norm = float(ff.clip_grad_norm_(grads, 0.5, norm_type=p))
        t = ff.clip_by_global_norm(0.5, norm_type=p)
        updates, _ = t.update(ff.reduce_grads(full, params), ff.EmptyState())
        donated, _ = t.update_donated(ff.reduce_grads(full, params), ff.EmptyState())
        offs = [
            max((got[k] - want[k]).abs().max().item() for k in full)
            for got in (ff.unshard(grads), ff.unshard(updates), ff.unshard(donated))
        ]
        predicted = ff.predict_collectives(plan, world, ff.Schedule(), optimizer=t, replicas=replicas)
        predicted = predicted[
            len(ff.predict_collectives(plan, world, ff.Schedule(), replicas=replicas)) :
        ]  # the clip's
        out[p] = (
            rel(norm, want_norm),
            offs,
            [(c.op, c.numel, c.world) for c in log.records],
            [(c.op, c.numel, c.world) for c in predicted],
        )
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_clip_norm_type_equals_torchs_clip_grad_norm(pool, world):
    # Catches (issue 42.11): no norm_type (before: a TypeError), a p-norm summed without ** p or
    # rooted without 1/p, an inf norm that sums the ranks' maxima (or keeps this rank's), a norm
    # that counts padding.
    for results in pool.run(_norm_types, world=world):
        assert set(results) == set(NORM_TYPES)
        for p, (norm_off, offs, logged, predicted) in results.items():
            assert norm_off < 1e-6, (p, norm_off)
            assert max(offs) < 1e-6, (p, offs)
            one = [("all_reduce", world if p == math.inf else 1, world)] * (world > 1)  # nothing recorded at W=1
            assert logged == one, (p, logged)
            assert predicted == one, (p, predicted)


def test_clip_norm_type_counts_the_replicas_once(pool):
    # Catches: a hybrid mesh's replicas (which hold the same shards) counted twice in a p-norm, or a
    # max-norm all-reduced over the replicas too (W numbers, 2 shards x 2 replicas).
    for results in pool.run(_norm_types, 2, world=4):
        for p, (norm_off, offs, logged, predicted) in results.items():
            assert norm_off < 1e-6 and max(offs) < 1e-6, (p, norm_off, offs)
            want = [("all_reduce", 2, 2)] if p == math.inf else [("all_reduce", 1, 2)] * 2  # over shards, replicas
            assert logged == predicted == want, (p, logged, predicted)


def test_norm_type_must_be_a_positive_number():
    # Catches: a norm_type of 0, a negative one or NaN taken (torch's 0 counts non-zeros: not a norm to clip by).
    for bad in (0, -1.0, math.nan):
        with pytest.raises(ValueError, match=r"clip_by_global_norm\(norm_type\) must be a number > 0 or math.inf"):
            ff.clip_by_global_norm(1.0, norm_type=bad)
    with pytest.raises(TypeError, match=r"clip_by_global_norm\(norm_type\) must be a number"):
        ff.clip_by_global_norm(1.0, norm_type="inf")


def _snapshot(tree):
    return [t.clone() for t in ff.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _unchanged(tree, snapshot) -> bool:
    now = [t for t in ff.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return len(now) == len(snapshot) and all(torch.equal(a, b) for a, b in zip(now, snapshot, strict=True))


def _echo_state() -> ff.GradientTransformation:
    """A hand-made link whose updates are its own state (the grads, kept): not fresh."""

    def update(grads, state, params=None):
        kept = ff.tree_map(lambda g: g.clone(), grads)
        return kept, kept

    return ff.GradientTransformation(lambda params: ff.tree_map(torch.zeros_like, params), update)


def _counting(calls: list[str]) -> ff.GradientTransformation:
    def update(grads, state, params=None):
        calls.append("update")
        return ff.tree_map(lambda g: g * 2, grads), state

    def update_donated(grads, state, params=None):
        calls.append("donated")
        return ff.tree_map(lambda g: g.mul_(2) if g.is_contiguous() else g, grads), state  # (not no-update zeros)

    return ff.GradientTransformation(lambda params: (), update, update_donated=update_donated)


def _chain_donates_its_own_updates(group, plan_kind):
    """A chain's ``update`` runs a link in place on the updates the fresh links before it made,
    with the bits of the links applied one by one, and changes nothing it is given."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = _TwoHeads()
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([nn.Linear])).grouped(1 if plan_kind == "per_layer" else 3)
    params = ff.shard(fn.params, plan, group)
    _, grads = ff.value_and_grad(fn, mse_loss)(params, fn.buffers, local_part(batch_for("mlp", MLP(), 0), rank, world))
    out = {}
    links = [ff.scale_by_adam(), ff.add_decayed_weights(0.1, _no_decay), ff.scale_by_learning_rate(lambda k: 1e-2)]
    chain = ff.chain(*links)
    state = chain.init(params)
    taken = _snapshot((grads, params, state))
    updates, new_state = chain.update(grads, state, params)
    by_hand, hand_states = grads, []
    for link, s in zip(links, state, strict=True):
        by_hand, s = link.update(by_hand, s, params)
        hand_states.append(s)
    out["same_bits"] = all(torch.equal(updates[u], by_hand[u]) for u in grads) and all(
        torch.equal(a, b)
        for a, b in zip(ff.tree_leaves(new_state), ff.tree_leaves(tuple(hand_states)), strict=True)
        if isinstance(a, torch.Tensor)
    )
    out["inputs_kept"] = _unchanged((grads, params, state), taken)
    # bf16 updates of float32 parameters: the decay promotes, so it is not done in place
    low = grads.replace({u: g.bfloat16() for u, g in grads.shards.items()})
    mixed = ff.chain(ff.scale(1.0), ff.add_decayed_weights(0.1))
    got = mixed.update(low, mixed.init(params), params)[0]
    want = ff.add_decayed_weights(0.1).update(ff.scale(1.0).update(low, ())[0], (), params)[0]
    out["mixed_dtypes"] = all(got[u].dtype == want[u].dtype and torch.equal(got[u], want[u]) for u in grads) and (
        any(got[u].dtype == torch.float32 for u in grads)  # (a reached unit's: promoted)
    )
    # a link that passes the given gradients through, or keeps its updates as its state: not reused
    taken = _snapshot(grads)
    through = ff.chain(ff.add_decayed_weights(0.0), ff.scale(3.0))
    got = through.update(grads, through.init(params), params)[0]
    out["pass_through_kept"] = _unchanged(grads, taken) and all(torch.equal(got[u], grads[u] * 3.0) for u in grads)
    echo = ff.chain(_echo_state(), ff.scale(3.0))
    _, (kept, _) = echo.update(grads, echo.init(params), params)
    out["echo_state_kept"] = all(torch.equal(kept[u], grads[u]) for u in grads)
    calls: list[str] = []
    for links_ in ([ff.scale_by_adam(), _counting(calls)], [_echo_state(), _counting(calls)], [_counting(calls)]):
        c = ff.chain(*links_)
        c.update(grads, c.init(params), params)
    out["calls"] = calls
    return out


@pytest.mark.parametrize("plan_kind", ["per_layer", "one_unit"])
def test_a_chain_reuses_only_the_updates_it_made(pool, plan_kind):
    # one_unit: head b, which no loss reaches, shares the unit with the reached parameters
    for out in pool.run(_chain_donates_its_own_updates, plan_kind, world=2):
        assert out["calls"] == ["donated", "update", "update"]
        assert out["same_bits"] and out["inputs_kept"] and out["mixed_dtypes"]
        assert out["pass_through_kept"] and out["echo_state_kept"]


def _new_shard_sized(group):
    """How many shard-sized tensors ``adamw``'s ``update`` allocates, counted at torch's dispatch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = MLP()
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group)
    _, grads = ff.value_and_grad(fn, mse_loss)(params, fn.buffers, local_part(batch_for("mlp", model, 0), rank, world))
    sizes = {t.numel() for t in params.shards.values()}

    class Count(TorchDispatchMode):
        new = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            inputs = [t for t in ff.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            given = {t.untyped_storage().data_ptr() for t in inputs}
            out = func(*args, **(kwargs or {}))
            for t in ff.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.numel() in sizes and t.untyped_storage().data_ptr() not in given:
                    Count.new += 1
            return out

    tx = ff.adamw(lr=1e-2, weight_decay=0.1)
    state = tx.init(params)
    with Count():
        tx.update(grads, state, params)
    return Count.new, len(params.shards)


def test_adamws_update_allocates_its_moments_and_its_update_only(pool):
    # before the chain reused its own updates: nine a unit (six in scale_by_adam, two in the
    # decay, one in the learning rate)
    for new, units in pool.run(_new_shard_sized, world=2):
        assert new == 3 * units
