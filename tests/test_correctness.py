"""Gradients are exactly torch's whatever the loss does with the model: extra no-grad calls,
calls thrown away, detached branches, units and parameters that get no gradient, repeated
calls. The reference is one process, torch.optim, the global batch; a parameter whose
``.grad`` stays ``None`` there is not stepped, and must not be stepped here either.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdp_fn as ff
from fsdp_fn.testing import assert_matches_unsharded
from tests.helpers import native_collectives, rel


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gate = nn.Linear(d, d)
        self.unused = nn.Parameter(torch.randn(3))  # registered, never used: torch never steps it

    def forward(self, x: torch.Tensor, gated: bool = True) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return x + (h * torch.sigmoid(self.gate(x)) if gated else h)


class Net(nn.Module):
    """``Sequential(Linear, Block, Block, Linear)`` with switches a loss can use to skip parts."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.out = nn.Linear(d, 3)

    def forward(
        self, x: torch.Tensor, upto: int = 2, gated: bool = True, head: bool = True, between=None, scale=None
    ) -> torch.Tensor:
        x = self.inp(x)
        if between is not None:
            x = between(x)
        for block in self.blocks[:upto]:
            x = block(x, gated=gated)
            if scale is not None:
                x.mul_(scale)  # a unit's output changed in place after it ran
        return self.out(x) if head else x


# Loss terms a user might write; each returns a differentiable term (or None) and may call
# the model in ways that get no gradient.
def _plain(m, x, y):
    return F.mse_loss(m(x), y)


def _nograd_extra(m, x, y):
    with torch.no_grad():
        m(x)  # a metric, a pseudo-label, an EMA target: no gradient
    return


def _discarded(m, x, y):
    m(x * 2)  # computed and thrown away
    return


def _detached_branch(m, x, y):
    return (m(x).detach() - y).square().mean() + F.mse_loss(m(x, upto=1), y)


def _first_block_only(m, x, y):
    return F.mse_loss(m(x, upto=1), y)  # blocks.1 gets no gradient


def _ungated(m, x, y):
    return m(x, gated=False).square().mean()  # every gate parameter gets no gradient


def _repeated(m, x, y):
    return F.mse_loss(m(x), y) + 0.5 * F.mse_loss(m(x * 0.5), y)


def _no_head(m, x, y):
    return m(x, head=False).square().mean()  # out.* gets no gradient


def _scaled_in_place(m, x, y):
    return F.mse_loss(m(x, scale=0.9), y)


def _vmapped(m, x, y):
    # Per-example losses with torch.func inside the loss: the step's own pass is plain
    # autograd, and a transform over the model's output composes with it.
    per_example = torch.func.vmap(lambda out, target: (out - target).square().mean())(m(x), y)
    return per_example.mean()


def _input_jvp(m, x, y):
    # A forward-mode derivative of the model in its input (a smoothness penalty): the tangent's
    # graph reads the units' parameters too, and must find them gathered in backward.
    out, tangent = torch.func.jvp(lambda a: m(a), (x,), (torch.ones_like(x),))
    return F.mse_loss(out, y) + 0.1 * tangent.square().mean()


def _per_example(m, x, y):
    # The model itself called under vmap, one example at a time.
    return torch.func.vmap(lambda xi, yi: F.mse_loss(m(xi[None]), yi[None]))(x, y).mean()


TERMS = {
    f.__name__.lstrip("_"): f
    for f in (
        _plain,
        _nograd_extra,
        _discarded,
        _detached_branch,
        _first_block_only,
        _ungated,
        _repeated,
        _no_head,
        _scaled_in_place,
        _vmapped,
        _input_jvp,
        _per_example,
    )
}


def make_loss(names):
    def loss_fn(model, batch):
        x, y = batch
        parts = [t for t in (TERMS[n](model, x, y) for n in names) if t is not None]
        return sum(parts[1:], parts[0])

    return loss_fn


def _reference(model, loss_fn, batches, lr):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    norms = []
    for b in batches:
        opt.zero_grad(set_to_none=True)
        loss_fn(model, b).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(torch.sqrt(sum(g.double().square().sum() for g in grads)).item())
        opt.step()
    return norms, {k: v.detach().clone() for k, v in model.named_parameters()}


def _batches(world, steps=3):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4 * world, 5, generator=g), torch.randn(4 * world, 3, generator=g)) for _ in range(steps)]


def _run(group, names, step_kw, split_root=False, under_no_grad=False, grouped=1):
    """Train sharded with the loss built from ``names``; compare with the reference on every rank.

    ``step_kw``: ``Schedule`` fields, ``clip`` for a chain that clips first, ``remat`` for train_step.
    ``under_no_grad``: every step is called inside ``torch.no_grad()`` (an evaluation loop's
    habit); the step still differentiates its loss."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = Net()
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]), split_root=split_root).grouped(grouped)
    schedule = {k: v for k, v in step_kw.items() if k not in ("clip", "remat")}
    opt = ff.adamw(lr=0.05, weight_decay=0.1)
    if "clip" in step_kw:
        opt = ff.chain(ff.clip_by_global_norm(step_kw["clip"]), opt)
    step = ff.train_step(fn, make_loss(names), opt, schedule=ff.Schedule(**schedule), remat=step_kw.get("remat"))
    state = step.init(ff.shard(fn.params, plan, group))
    batches = _batches(world)
    norms = []
    micro = schedule.get("micro_batches", 1)
    for b in batches:
        local = tuple(t.chunk(world)[rank] for t in b)
        if micro > 1:  # the same examples as micro-batches
            local = [tuple(t.chunk(micro)[i] for t in local) for i in range(micro)]
        with torch.no_grad() if under_no_grad else contextlib.nullcontext():
            state, metrics = step(state, local)
        norms.append(metrics["grad_norm"].item())
    full = ff.unshard(state.params)
    ref_norms, ref_params = _reference(model, make_loss(names), batches, 0.05)
    return (
        max(rel(a, b) for a, b in zip(norms, ref_norms)),
        max((full[k] - v).abs().max().item() for k, v in ref_params.items()),
        # parameters torch never stepped must be bitwise what they were
        all(torch.equal(full[k], v.detach()) for k, v in model.named_parameters() if torch.equal(ref_params[k], v)),
    )


def _check(results):
    # Measured: grad norms within 3e-7 relative, parameters within 2e-7; a wrongly dropped
    # or zero-stepped parameter moves by ~5e-2 (lr) and fails both by orders of magnitude.
    for norm, param, untouched in results:
        assert norm < 1e-5, norm
        assert param < 1e-5, param
        assert untouched


@pytest.mark.parametrize(
    "step_kw", [{}, {"remat": True}, {"update_in_backward": True}], ids=["default", "remat", "uib"]
)
@pytest.mark.parametrize(
    "names",
    [
        ["first_block_only", "ungated"],  # the group's last module never runs: its gather ends with the forward
        ["repeated", "plain"],
        ["no_head", "discarded"],
        ["nograd_extra", "detached_branch"],
        ["vmapped", "per_example"],
    ],
    ids=lambda names: "+".join(names),
)
def test_one_unit_of_both_blocks_trains_like_one_process_under_unusual_losses(pool, names, step_kw):
    # Catches: a group gathered once per module (its gradient reduced twice), a group whose
    # last module did not run left gathered or never refilled, remat of a group's modules
    # outside its gather, update_in_backward stepping a group before its first module's backward.
    _check(pool.run(_run, names, step_kw, grouped=2, world=2))


def _group_gathers(group, names):
    """The all-gathers of one unit of both blocks in a step after the first (its collective log)."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = Net()
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]), split_root=True).merged(["blocks.0", "blocks.1"])
    schedule = ff.Schedule(keep_tail_gathered=False)  # (else the units before the head stay gathered)
    step = ff.train_step(fn, make_loss(names), ff.adamw(lr=0.05), schedule=schedule)
    state = step.init(ff.shard(fn.params, plan, group))
    for b in _batches(world, 2):
        with ff.comm_log() as log:
            state, _ = step(state, tuple(t.chunk(world)[rank] for t in b))
    return [c.op for c in log.records if c.unit == "blocks.0..blocks.1"]


@pytest.mark.parametrize("names", [["plain"], ["first_block_only"]])
def test_one_unit_of_both_blocks_is_gathered_once_and_refilled_once(pool, names):
    # Catches: each block gathering the unit again (a gather and a reduction per block), and a
    # group whose last block did not run left gathered after forward (no refill for backward).
    assert pool.run(_group_gathers, names, world=2)[0] == ["all_gather", "all_gather", "reduce_scatter"]


@pytest.mark.parametrize("world", [1, 2])
def test_a_step_under_no_grad_with_a_vmapped_loss(pool, world):
    _check(pool.run(_run, ["vmapped", "nograd_extra"], {}, under_no_grad=True, world=world))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_issue_example_no_grad_metric_keeps_the_gradients(pool, world):
    """The reported case: a no-grad forward before the real one wiped out every gradient."""
    _check(pool.run(_run, ["nograd_extra", "plain"], {}, world=world))


@pytest.mark.parametrize(
    "step_kw",
    [
        {},
        {"update_in_backward": True},
        {"reshard_after_forward": False},
        {"clip": 1e9},
        {"micro_batches": 2},
        {"micro_batches": 2, "reduce_each_micro_batch": False},
        {"remat": True},  # a recomputed block: its unused parameters get no gradient either
    ],
    ids=["default", "update_in_backward", "keep_gathered", "clip", "accumulate_sharded", "accumulate_full", "remat"],
)
def test_units_and_parameters_without_gradient_are_not_stepped(pool, step_kw):
    """Unused parameters, a skipped block, an unused head: skipped per parameter, in every mode."""
    _check(pool.run(_run, ["first_block_only", "ungated"], step_kw, world=2))
    _check(pool.run(_run, ["no_head", "discarded"], step_kw, world=3))


@pytest.mark.parametrize("step_kw", [{}, {"update_in_backward": True}], ids=["default", "update_in_backward"])
def test_a_parameter_only_an_earlier_call_reaches_is_stepped(pool, step_kw):
    """The first call skips the gates, the second uses them. Backward reaches the second
    call's uses first and the first call's last: a gate is still marked as having got its
    gradient (and so is stepped, weight decay included) after a use that did not reach it."""
    _check(pool.run(_run, ["ungated", "first_block_only"], step_kw, world=2))


@pytest.mark.parametrize(
    "step_kw",
    [{}, {"reshard_after_forward": False}, {"update_in_backward": True}, {"remat": True}],
    ids=["default", "keep_gathered", "update_in_backward", "remat"],
)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_units_output_changed_in_place_after_it_ran(pool, step_kw, world):
    """Plain torch lets code after a module change its output in place (when no backward of
    the module reads it); so must the step: its refill before a unit's backward is a hook on
    the outputs' gradients, not an identity function whose outputs autograd forbids changing."""
    _check(pool.run(_run, ["scaled_in_place"], step_kw, world=world))


@pytest.mark.parametrize(
    "step_kw",
    [{}, {"update_in_backward": True}, {"remat": True}],
    ids=["default", "update_in_backward", "remat"],
)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_loss_that_transforms_the_model_itself(pool, step_kw, world):
    """``torch.func.jvp`` and ``vmap`` over the model inside the loss: a tangent's backward
    reads the units' parameters (before: freed storage at W >= 2), and a vmapped call goes
    through the gathers (before: ``GatherUnit`` has no vmap support)."""
    _check(pool.run(_run, ["input_jvp"], step_kw, world=world))
    _check(pool.run(_run, ["per_example", "plain"], step_kw, world=world))


def _module_read_in_loss(group, how, update_in_backward):
    """A loss that reads the module's own parameters, not through ``model(...)``: the first
    step raises naming one; then a plain step on the same state is torch's."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    module = Net()
    before = {k: v.detach().clone() for k, v in module.named_parameters()}
    captured = list(module.parameters())  # a reference taken before any step

    def reading(m, b):
        x, y = b
        if how == "parameters":  # plain torch's L2 penalty, written against the module
            return F.mse_loss(m(x), y) + 1e-3 * sum(p.square().sum() for p in module.parameters())
        if how == "captured":
            return F.mse_loss(m(x), y) + 1e-3 * sum(p.square().sum() for p in captured)
        if how == "head":  # the head applied by hand to the model's features
            return F.mse_loss(module.out(m(x, head=False)), y)
        # what a parameter is, not its values: allowed
        dtype, count = next(module.parameters()).dtype, sum(p.numel() for p in module.parameters())
        return F.mse_loss(m(x).to(dtype), y) * (count / count)

    fn = ff.functionalize(module)
    plan = ff.make_plan(module, ff.layer_policy([Block]))
    schedule = ff.Schedule(update_in_backward=update_in_backward)
    (batch,) = _batches(world, 1)
    local = tuple(t.chunk(world)[rank] for t in batch)
    state = ff.train_step(fn, reading, ff.adamw(lr=0.05, weight_decay=0.1), schedule=schedule).init(
        ff.shard(fn.params, plan, group)
    )
    step = ff.train_step(fn, reading, ff.adamw(lr=0.05, weight_decay=0.1), schedule=schedule)
    try:
        state, _ = step(state, local)
        error = None
    except RuntimeError as e:
        error = str(e) + " | " + " ".join(getattr(e, "__notes__", []))
    untouched = all(a is b for a, b in zip(captured, module.parameters(), strict=True)) and all(
        torch.equal(before[k], v) for k, v in module.named_parameters()
    )
    if error is not None and "restore the last checkpoint" in error:
        return error, untouched, None
    plain = ff.train_step(fn, make_loss(["plain"]), ff.adamw(lr=0.05, weight_decay=0.1), schedule=schedule)
    state, _ = plain(state, local)
    full = ff.unshard(state.params)
    # the reading loss equals the plain one where it is allowed: one plain step, or two
    _, ref = _reference(module, make_loss(["plain"]), [batch] if error else [batch, batch], 0.05)
    return error, untouched, max((full[k] - v).abs().max().item() for k, v in ref.items())


@pytest.mark.parametrize("update_in_backward", [False, True], ids=["default", "update_in_backward"])
@pytest.mark.parametrize("how", ["parameters", "captured", "head", "metadata"])
def test_the_modules_own_parameters_read_in_the_loss_raise_naming_one(pool, how, update_in_backward):
    """Inside a step the module keeps its original values and the gradient to them would be
    dropped: a read raises at once (nothing applied), a reference taken before the step is
    caught when backward reaches it. Reading what a parameter is (dtype, numel) is allowed."""
    for error, untouched, diff in pool.run(_module_read_in_loss, how, update_in_backward, world=2):
        assert untouched  # the module itself: same parameter objects, same values
        if how == "metadata":
            assert error is None and diff < 1e-6, (error, diff)
            continue
        want = {
            "parameters": "loss_fn read parameter 'inp.weight' of the module itself (square)",
            "captured": "loss_fn's loss depends on parameter 'inp.weight' of the module itself (and 13 more)",
            "head": "loss_fn read parameter 'out.weight' of the module itself (linear)",
        }[how]
        assert want in error, error
        if how == "captured" and update_in_backward:  # found after backward, which stepped the units
            assert diff is None and "already stepped units" in error
        else:  # raised before anything was applied: the next step is the reference's first
            assert diff < 1e-6, diff


class Reparametrised(nn.Module):
    """A block whose weight is computed from its parameters each call: by a forward pre-hook
    (the older ``spectral_norm``, which also updates buffers in place) or a parametrization."""

    def __init__(self, how: str) -> None:
        super().__init__()
        lin = nn.Linear(7, 7)
        wrap = {
            "spectral_norm_hook": nn.utils.spectral_norm,
            "spectral_norm": nn.utils.parametrizations.spectral_norm,
            "weight_norm": nn.utils.parametrizations.weight_norm,
            "orthogonal": nn.utils.parametrizations.orthogonal,
        }[how]
        self.lin = wrap(lin)
        self.skip = nn.Linear(7, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x)) * self.skip(x)


def _reparametrised(group, how):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 7), Reparametrised(how), Reparametrised(how), nn.Linear(7, 3))
    world = group.size()
    batches = [(torch.randn(2 * world, 5, generator=g), torch.randn(2 * world, 3, generator=g)) for _ in range(3)]
    return assert_matches_unsharded(
        model,
        lambda m, b: F.mse_loss(m(b[0]), b[1]),
        batches,
        group=group,
        policy=ff.layer_policy([nn.Linear]),  # the module with the hook or parametrization is a unit
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.05),
    )


@pytest.mark.parametrize("how", ["spectral_norm_hook", "spectral_norm", "weight_norm", "orthogonal"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_unit_that_computes_its_weight_trains_like_one_process(pool, how, world):
    """The unit is gathered before any pre-hook of the module's own runs: the older
    spectral_norm reads its ``weight_orig`` in one (before, it read a parameter not yet there)."""
    for worst in pool.run(_reparametrised, how, world=world):
        assert worst["parameter"] < 1e-5 and worst["loss"] < 1e-5, worst


class Clamping(nn.Module):
    """Clamps its own weight in place in forward, when asked: a change plain torch keeps."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.lin = nn.Linear(5, 6)

    def forward(self, x: torch.Tensor, clamp: bool) -> torch.Tensor:
        if clamp and self.how == "data":
            self.lin.weight.data.clamp_(-0.2, 0.2)
        elif clamp:
            with torch.no_grad():
                self.lin.weight.clamp_(-0.2, 0.2)
        return torch.tanh(self.lin(x))


class ClampNet(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.body = Clamping(how)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, clamp: bool = False) -> torch.Tensor:
        return self.out(self.body(x, clamp))


def _clamped_in_forward(group, how, where):
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = ClampNet(how)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Clamping]) if where == "unit" else None)
    (batch,) = _batches(world, 1)
    x, y = (t.chunk(world)[rank] for t in batch)
    step = ff.train_step(fn, lambda m, b: F.mse_loss(m(b[0], clamp=b[2]), b[1]), ff.adamw(lr=0.05))
    state = step.init(ff.shard(fn.params, plan, group))
    try:
        step(state, (x, y, True))
        error = "no error"
    except RuntimeError as e:
        error = " | ".join([str(e), *getattr(e, "__notes__", [])])
    state, metrics = step(state, (x, y, False))  # the state is still usable
    return error, float(metrics["loss"])


@pytest.mark.parametrize("where", ["unit", "root"])
@pytest.mark.parametrize("how", ["data", "no_grad"])
def test_a_forward_that_changes_its_parameters_in_place_raises_naming_it(pool, how, where):
    """Plain torch keeps a forward's in-place change to its weight (a clamp); a gathered copy
    would lose it. Through ``.data`` autograd sees nothing: the step's first call compares a
    fingerprint of the unit's parameters before and after its forward. Under no_grad
    autograd refuses the change, and the error gets a note that says what happened."""
    label = "'body'" if where == "unit" else "(root)"
    for error, loss in pool.run(_clamped_in_forward, how, where, world=2):
        if how == "data":
            assert f"the forward of unit {label} changed parameter 'body.lin.weight' in place" in error, error
        else:
            unit = "unit 'body'" if where == "unit" else "the root unit"
            assert f"the forward of {unit} changed one of its parameters in place" in error, error
        assert "the change would be lost" in error
        assert math.isfinite(loss)


@settings(max_examples=60, deadline=None)
@given(
    offset=st.integers(0, 9),
    numel=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    data=st.data(),
)
def test_a_fingerprint_sees_a_change_to_any_element(offset, numel, dtype, data):
    """The in-place check's fingerprint sums 8-byte words plus the unaligned bytes at either
    end of a parameter's view: a change to any one element, aligned or not, changes it."""
    from fsdp_fn._runtime import _fingerprints

    flat = torch.arange(offset + numel + 3, dtype=dtype)
    view = flat[offset : offset + numel]
    before = _fingerprints({"w": view})
    view[data.draw(st.integers(0, numel - 1))] += 1
    assert _fingerprints({"w": view}) != before


class Gated(nn.Module):
    """A unit whose small parameters sit off the 8-byte grid in its flat buffer (bf16: 2 bytes each)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.ones(1))
        self.shift = nn.Parameter(torch.zeros(1))
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(x) * self.gate + self.shift


def _small_bf16_parameters(group):
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = nn.Sequential(Gated(), nn.Tanh(), Gated()).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = torch.randn(4, 6, dtype=torch.bfloat16), torch.randn(4, 6, dtype=torch.bfloat16)
    fn = ff.functionalize(model)
    step = ff.train_step(fn, lambda m, b: F.mse_loss(m(b[0]), b[1]), ff.sgd(lr=0.1))
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([Gated])), group))
    for _ in range(2):  # the first step is checked: parameters fingerprinted around each forward
        state, _ = step(state, (x.chunk(world)[rank], y.chunk(world)[rank]))
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
    full = ff.unshard(state.params)
    return max((full[k].float() - p.detach().float()).abs().max().item() for k, p in ref.named_parameters())


def test_small_bf16_parameters_off_the_word_grid_train_like_one_process(pool):
    """A one-element bf16 parameter two bytes into a word: its fingerprint slice used to be
    an empty tensor off the 8-byte grid, which torch refuses to view as int64 (the first
    step of any such model failed)."""
    for worst in pool.run(_small_bf16_parameters, world=2):
        assert worst < 2e-2  # bf16: a rank's half-batch gradient rounds differently from the whole batch's


UNFREEZES = {  # what is frozen at make_plan, and when (before which step) it is unfrozen
    "a_whole_unit": ("blocks.0", 2),  # a unit with no trainable parameter until then
    "part_of_a_unit": ("inp", 1),  # the root unit: inp joins out's trainable part
    "then_frozen_again": ("blocks.1.fc", 1),  # unfrozen, then frozen again at step 3
}


def _unfrozen_after_the_plan(group, change, optimizer, update_in_backward):
    """Progressive unfreezing (FSDP2's users unfreeze layers between steps): frozen at
    make_plan, made trainable later, the step moves them into training itself; a
    value_and_grad loop refuses until ``train_unfrozen`` does it."""
    world, rank = group.size(), group.rank()
    path, when = UNFREEZES[change]
    torch.manual_seed(0)
    module = Net()
    _set(module, path, False)
    fn = ff.functionalize(module)
    opt = {"adamw": ff.adamw(lr=0.05, weight_decay=0.1), "sgd": ff.sgd(lr=0.05, momentum=0.9)}[optimizer]
    step = ff.train_step(fn, make_loss(["plain"]), opt, schedule=ff.Schedule(update_in_backward=update_in_backward))
    state = step.init(ff.shard(fn.params, ff.make_plan(module, ff.layer_policy([Block])), group))
    planned = state.params.plan
    errors, norms = [], []
    for k, b in enumerate(_batches(world, 5)):
        local = tuple(t.chunk(world)[rank] for t in b)
        if k == when:
            _set(module, path, True)
            try:
                ff.value_and_grad(fn, make_loss(["plain"]))(state.params, fn.buffers, local)
            except ValueError as e:
                errors.append(str(e))
        if k == 3 and change == "then_frozen_again":
            _set(module, path, False)
        state, metrics = step(state, local)
        norms.append(float(metrics["grad_norm"]))
    moved = [s.name for u in state.params.plan.units for s in u.params if s not in planned.unit(u.name).params]
    return ff.unshard(state.params), norms, errors, moved


@pytest.mark.parametrize("update_in_backward", [False, True], ids=["default", "update_in_backward"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("change", list(UNFREEZES))
def test_unfreezing_a_parameter_the_plan_holds_frozen_trains_like_torch(pool, change, optimizer, update_in_backward):
    """torch.optim built once over every parameter makes a parameter's state at its first
    gradient (zero moments, step 0; SGD's momentum buffer is that first gradient). The step
    gives an unfrozen parameter the same, keeps every other parameter's state, and a
    value_and_grad loop is told what to call. Before, the step refused any unfreezing."""
    path, when = UNFREEZES[change]
    torch.manual_seed(0)
    ref = Net()
    _set(ref, path, False)
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    }[optimizer]
    opt = make(list(ref.parameters()))
    norms = []
    for k, b in enumerate(_batches(2, 5)):
        if k == when:
            _set(ref, path, True)
        if k == 3 and change == "then_frozen_again":
            _set(ref, path, False)
        make_loss(["plain"])(ref, b).backward()
        grads = [p.grad for p in ref.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        opt.step()
        ref.zero_grad(set_to_none=True)
    for full, got, errors, moved in pool.run(_unfrozen_after_the_plan, change, optimizer, update_in_backward, world=2):
        for name, p in ref.named_parameters():
            torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        assert got == pytest.approx(norms, rel=1e-5)
        assert sorted(moved) == sorted(n for n, _ in ref.named_parameters() if n.startswith(path + "."))
        assert len(errors) == 1 and "ff.train_unfrozen(params, opt_state, optimizer, fn.module)" in errors[0]


def _unfrozen_then_resumed(group, directory):
    """Unfrozen after the plan, stepped, saved; resumed by a job that plans with the flags as
    they are now (the unfrozen parameter trainable from the start, in module order): the same
    parameters and optimizer state, so the next step equals the uninterrupted one."""
    world, rank = group.size(), group.rank()
    batches = [tuple(t.chunk(world)[rank] for t in b) for b in _batches(world, 3)]
    torch.manual_seed(0)
    module = Net()
    module.inp.requires_grad_(False)
    fn = ff.functionalize(module)
    step = ff.train_step(fn, make_loss(["plain"]), ff.adamw(lr=0.05, weight_decay=0.1))
    state = step.init(ff.shard(fn.params, ff.make_plan(module, ff.layer_policy([Block])), group))
    state, _ = step(state, batches[0])
    module.inp.requires_grad_(True)
    state, _ = step(state, batches[1])
    ff.checkpoint.save(directory, state)
    state, _ = step(state, batches[2])
    torch.manual_seed(1)  # another job: other initial values, the flags as they are now
    fresh = Net()
    fresh_fn = ff.functionalize(fresh)
    resumed_step = ff.train_step(fresh_fn, make_loss(["plain"]), ff.adamw(lr=0.05, weight_decay=0.1))
    like = resumed_step.init(ff.shard(fresh_fn.params, ff.make_plan(fresh, ff.layer_policy([Block])), group))
    resumed, _ = ff.checkpoint.load(directory, like)
    resumed, _ = resumed_step(resumed, batches[2])
    return ff.unshard(state.params), ff.unshard(resumed.params)


def test_a_state_unfrozen_after_the_plan_saves_and_resumes_under_a_plan_made_now(pool, tmp_path):
    for want, got in pool.run(_unfrozen_then_resumed, str(tmp_path / "ckpt"), world=2):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def _unfrozen_in_a_loop_of_ones_own(group):
    """value_and_grad -> update -> apply_updates, with ``train_unfrozen`` after unfreezing, at
    an uneven world (W = 3 shards a 5 x 6 weight unevenly); torch.optim on one process beside it."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    module = Net()
    module.inp.requires_grad_(False)
    ref = copy.deepcopy(module)
    torch_opt = torch.optim.AdamW(list(ref.parameters()), lr=0.05, weight_decay=0.1)
    fn = ff.functionalize(module)
    opt = ff.adamw(lr=0.05, weight_decay=0.1)
    params = ff.shard(fn.params, ff.make_plan(module, ff.layer_policy([Block])), group)
    opt_state = opt.init(params)
    for k, b in enumerate(_batches(world, 3)):
        if k == 1:
            module.inp.requires_grad_(True)
            ref.inp.requires_grad_(True)
            params, opt_state = ff.train_unfrozen(params, opt_state, opt, module)
        _, grads = ff.value_and_grad(fn, make_loss(["plain"]))(
            params, fn.buffers, tuple(t.chunk(world)[rank] for t in b)
        )
        updates, opt_state = opt.update(grads, opt_state, params)
        params = ff.apply_updates(params, updates)
        make_loss(["plain"])(ref, b).backward()
        torch_opt.step()
        ref.zero_grad(set_to_none=True)
    return ff.unshard(params), {n: p.detach() for n, p in ref.named_parameters()}


def test_train_unfrozen_in_a_loop_of_ones_own_trains_like_torch(pool):
    for full, want in pool.run(_unfrozen_in_a_loop_of_ones_own, world=3):
        for name, p in want.items():
            torch.testing.assert_close(full[name], p, rtol=1e-5, atol=1e-5, msg=name)


FREEZES = {  # step -> (module path, requires_grad) set before it
    "freeze": {1: ("blocks.0", False)},
    "freeze_then_unfreeze": {1: ("blocks.0", False), 3: ("blocks.0", True)},
    "part_of_a_unit": {1: ("blocks.1.fc.bias", False), 2: ("inp", False), 3: ("inp", True)},
}


def _set(module, path, flag):
    target = module.get_parameter(path) if path.endswith(("weight", "bias")) else module.get_submodule(path)
    target.requires_grad_(flag)


def _frozen_mid_training(group, change, optimizer, update_in_backward):
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    module = Net()
    fn = ff.functionalize(module)
    opt = {"adamw": ff.adamw(lr=0.05, weight_decay=0.1), "sgd": ff.sgd(lr=0.05, momentum=0.9)}[optimizer]
    schedule = ff.Schedule(update_in_backward=update_in_backward)
    step = ff.train_step(fn, make_loss(["plain"]), opt, schedule=schedule)
    state = step.init(ff.shard(fn.params, ff.make_plan(module, ff.layer_policy([Block])), group))
    norms = []
    for k, b in enumerate(_batches(world, 5)):
        if k in FREEZES[change]:
            _set(module, *FREEZES[change][k])
        state, metrics = step(state, tuple(t.chunk(world)[rank] for t in b))
        norms.append(float(metrics["grad_norm"]))
    return ff.unshard(state.params), norms


@pytest.mark.parametrize("update_in_backward", [False, True], ids=["default", "update_in_backward"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("change", list(FREEZES))
def test_freezing_and_unfreezing_after_the_plan_trains_like_torch(pool, change, optimizer, update_in_backward):
    """``requires_grad_(False)`` between steps (as FSDP2's tests do) on a parameter the plan holds
    trainable: it reaches no gradient, keeps its value and optimizer state (torch.optim skips a
    ``None`` gradient) and leaves the gradient norm; ``requires_grad_(True)`` trains it again with
    the state it kept. Before, the step refused any change after the plan."""
    torch.manual_seed(0)
    ref = Net()
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    }[optimizer]
    opt = make(list(ref.parameters()))  # built once: a frozen parameter keeps its state
    norms = []
    for k, b in enumerate(_batches(2, 5)):
        if k in FREEZES[change]:
            _set(ref, *FREEZES[change][k])
        make_loss(["plain"])(ref, b).backward()
        grads = [p.grad for p in ref.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        opt.step()
        ref.zero_grad(set_to_none=True)
    for full, got in pool.run(_frozen_mid_training, change, optimizer, update_in_backward, world=2):
        for name, p in ref.named_parameters():
            torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        assert got == pytest.approx(norms, rel=1e-5)


def _value_and_grad_after_freezing(group):
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    module = Net()
    fn = ff.functionalize(module)
    params = ff.shard(fn.params, ff.make_plan(module, ff.layer_policy([Block])), group)
    module.blocks[1].fc.bias.requires_grad_(False)  # after the plan: part of a unit
    b = _batches(world, 1)[0]
    _, grads = ff.value_and_grad(fn, make_loss(["plain"]))(params, fn.buffers, tuple(t.chunk(world)[rank] for t in b))
    received = {s.name: got for u in grads.plan.units for s, got in zip(u.params, grads.received[u.name])}
    return ff.unshard(grads), received


def test_value_and_grad_gives_a_parameter_frozen_after_the_plan_no_gradient(pool):
    """As torch gives it ``None``: zeros in the gradient shards (a norm of them counts nothing)
    and not received; every other gradient is torch's, received where torch's is not ``None``."""
    torch.manual_seed(0)
    ref = Net()
    ref.blocks[1].fc.bias.requires_grad_(False)
    make_loss(["plain"])(ref, _batches(2, 1)[0]).backward()
    for full, received in pool.run(_value_and_grad_after_freezing, world=2):
        assert received == {name: p.grad is not None for name, p in ref.named_parameters()}
        assert not received["blocks.1.fc.bias"]
        assert not full["blocks.1.fc.bias"].any()
        for name, p in ref.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(full[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def _losses_that_change(group, per_step, optimizer, update_in_backward):
    """A different loss at each step (a multi-task loop: a head unused at some steps); every
    parameter keeps its own step count, as torch.optim does."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = Net()
    batches = _batches(world, len(per_step))
    make = {
        "adamw": (
            lambda: ff.adamw(lr=0.05, weight_decay=0.1),
            lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
        ),
        "sgd": (lambda: ff.sgd(lr=0.05, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    }[optimizer]
    ref = copy.deepcopy(model)
    opt = make[1](ref.parameters())
    for names, b in zip(per_step, batches, strict=True):
        opt.zero_grad(set_to_none=True)
        make_loss(names)(ref, b).backward()
        opt.step()
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]))
    state = None
    for names, b in zip(per_step, batches, strict=True):
        step = ff.train_step(
            fn, make_loss(names), make[0](), schedule=ff.Schedule(update_in_backward=update_in_backward)
        )
        state = step.init(ff.shard(fn.params, plan, group)) if state is None else state
        state, _ = step(state, tuple(t.chunk(world)[rank] for t in b))
    full = ff.unshard(state.params)
    return max((full[k] - v).abs().max().item() for k, v in ref.named_parameters())


@pytest.mark.parametrize("update_in_backward", [False, True], ids=["default", "update_in_backward"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("world", [1, 2])
def test_a_parameter_skipped_at_an_earlier_step_keeps_its_own_step_count(pool, world, optimizer, update_in_backward):
    """Step 1 skips the head, step 4 the second block; the others use every parameter: the unit's
    step counts differ, so it is stepped per parameter, and each count must move on its own.
    (Before, a unit whose parameters all got a gradient had every count set to its first one
    after the step: the head's AdamW bias correction ran a step ahead, 1e-2 off torch.)"""
    per_step = [["no_head"], ["plain"], ["plain"], ["first_block_only"], ["plain"]]
    for diff in pool.run(_losses_that_change, per_step, optimizer, update_in_backward, world=world):
        assert diff < 1e-5, diff


def _uneven(group, reduction):
    """Ranks with 5 and 3 examples of one global batch of 8."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = Net()
    (batch,) = _batches(world, 1)
    sizes = [5, 3]
    start = sum(sizes[:rank])
    local = tuple(t[start : start + sizes[rank]] for t in batch)

    def loss_fn(m, b):
        x, y = b
        if reduction == "mean":  # each rank's own mean: the step then averages the ranks' means
            return F.mse_loss(m(x), y)
        # a sum over this rank's examples, scaled so that the ranks' mean is the global mean
        return F.mse_loss(m(x), y, reduction="sum") * world / (sum(sizes) * y.shape[1])

    fn = ff.functionalize(model)
    step = ff.train_step(fn, loss_fn, ff.sgd(lr=0.1))
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([Block])), group))
    state, metrics = step(state, local)
    ref = copy.deepcopy(model)
    F.mse_loss(ref(batch[0]), batch[1]).backward()
    with torch.no_grad():
        for p in ref.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    full = ff.unshard(state.params)
    return max((full[k] - v).abs().max().item() for k, v in ref.named_parameters())


def test_ranks_with_unequal_batches_need_a_sum_scaled_by_the_global_count(pool):
    """The step averages the ranks' losses (as DDP averages gradients): with unequal batches a
    per-rank mean weighs each rank's examples by 1/its count, not the global mean. A sum
    scaled by W / the global count is the global mean exactly (docs/errors.md)."""
    mean, scaled = pool.run(_uneven, "mean", world=2), pool.run(_uneven, "sum", world=2)
    assert all(d > 1e-4 for d in mean), mean  # the difference is real, not rounding
    assert all(d < 1e-6 for d in scaled), scaled


def _loss_family(group, examples):
    @settings(max_examples=examples)
    @given(
        names=st.lists(st.sampled_from(sorted(TERMS)), min_size=1, max_size=3).filter(
            lambda ns: any(n not in ("nograd_extra", "discarded") for n in ns)
        ),
        uib=st.booleans(),
        split_root=st.booleans(),
    )
    def prop(names, uib, split_root):
        kw = {"update_in_backward": True} if uib else {}
        # every compared value is replicated, so every rank fails (and shrinks) alike
        _check([_run(group, names, kw, split_root=split_root)])

    prop()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_loss_family_matches_torch(pool, world):
    """Drawn losses: extra no-grad calls, discarded calls, detached branches, unused units, repeats."""
    assert all(pool.run(_loss_family, 8, world=world))


def _detached_loss(group):
    torch.manual_seed(0)
    model = Net()
    fn = ff.functionalize(model)
    step = ff.train_step(fn, lambda m, b: F.mse_loss(m(b[0]), b[1]).detach(), ff.adamw())
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([Block])), group))
    before = ff.unshard(state.params)
    try:
        step(state, (torch.randn(4, 5), torch.randn(4, 3)))
    except ValueError as e:
        message = str(e)
    after = ff.unshard(state.params)
    return message, all(torch.equal(before[k], after[k]) for k in before)


def test_a_loss_that_does_not_require_grad_raises_before_anything_is_applied(pool):
    for message, untouched in pool.run(_detached_loss, world=2):
        assert "loss_fn returned a loss that does not require grad" in message
        assert "nothing was applied" in message
        assert untouched  # AdamW's weight decay did not move anything


def _from_torch_partial_unit(group):
    torch.manual_seed(0)
    model = Net()
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([Block])), group)
    step = ff.train_step(fn, make_loss(["plain"]), ff.from_torch(torch.optim.SGD(list(params.values()), lr=0.1)))
    try:
        step(step.init(params), (torch.randn(4, 5), torch.randn(4, 3)))
    except ValueError as e:
        return str(e)
    return "no error"


def test_from_torch_names_parameters_it_cannot_skip(pool):
    (message,) = pool.run(_from_torch_partial_unit, world=1)
    assert "parameters ['blocks.0.unused'] of unit 'blocks.0' got no gradient" in message
    assert "use ff.adamw or ff.sgd" in message


_ARMED = [True]


class _Boom(torch.autograd.Function):
    """Identity whose first backward raises (on every rank)."""

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        if _ARMED[0]:
            _ARMED[0] = False
            raise RuntimeError("backward failed between inp and blocks.0")
        return g


def _raise_in_backward(group, update_in_backward):
    """An exception inside one unit's backward on every rank, then a retry."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = Net()
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]))

    def loss_fn(m, b):
        x, y = b
        # between inp and blocks.0: its backward runs after blocks.1's and blocks.0's
        return F.mse_loss(m(x, between=_Boom.apply), y)

    _ARMED[0] = True
    schedule = ff.Schedule(update_in_backward=update_in_backward)
    step = ff.train_step(fn, loss_fn, ff.adamw(lr=0.05), schedule=schedule)
    state = step.init(ff.shard(fn.params, plan, group))
    batch = tuple(t.chunk(world)[rank] for t in _batches(world, 1)[0])
    try:
        step(state, batch)
        first = "no error"
    except RuntimeError as e:
        first = str(e) + " | " + " ".join(getattr(e, "__notes__", []))
    try:
        state, metrics = step(state, batch)
        second = f"ok {metrics['loss'].item()}"
    except RuntimeError as e:
        second = f"error: {e}"
    if not update_in_backward:
        return first, second
    # the way back: a state rebuilt (here from the module, as from a checkpoint) trains, nothing
    # of the failed step's exchanges (reduce-scatters, mask merges) left in flight to meet it
    fresh = step.init(ff.shard(fn.params, plan, group))
    _, metrics = step(fresh, batch)
    clean = ff.train_step(fn, loss_fn, ff.adamw(lr=0.05), schedule=schedule)
    _, want = clean(clean.init(ff.shard(fn.params, plan, group)), batch)
    return first, second, metrics["loss"].item() == want["loss"].item()


def test_update_in_backward_failure_is_detected_not_applied_twice(pool):
    for first, second, restored in pool.run(_raise_in_backward, True, world=2):
        assert restored
        assert "backward failed between inp and blocks.0" in first
        assert "already stepped units 'blocks.1':" in first  # blocks.0's reduce-scatter was still in flight
        # the retry does not silently apply the same updates again
        assert second.startswith("error: step 2: step 1 failed after update_in_backward had already stepped units")
        assert "restore the last checkpoint" in second


def test_without_update_in_backward_a_failed_backward_leaves_the_state_usable(pool):
    for first, second in pool.run(_raise_in_backward, False, world=2):
        assert "backward failed between inp and blocks.0" in first
        assert second.startswith("ok")


def _donated(group):
    torch.manual_seed(0)
    model = Net()
    fn = ff.functionalize(model)
    step = ff.train_step(fn, make_loss(["plain"]), ff.adamw())
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([Block])), group))
    batch = (torch.randn(4, 5), torch.randn(4, 3))
    new, _ = step(state, batch)
    messages = []
    for use in (lambda: step(state, batch), lambda: ff.unshard(state.params)):
        try:
            use()
            messages.append("no error")
        except RuntimeError as e:
            messages.append(str(e))
    new, _ = step(new, batch)  # the returned state works
    return messages


def test_donated_state_refuses_reuse(pool):
    for messages in pool.run(_donated, world=2):
        for m in messages:
            assert "these shards were donated to step 1" in m, m
            assert "use the state the step returned, or build the step with donate=False" in m


class SharingBlock(nn.Module):
    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.shared = shared  # the same module object in two blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.shared(torch.tanh(self.fc(x))))


def _shared_module(group, split_root):
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    shared = nn.Linear(6, 6)
    model = nn.Sequential(nn.Linear(5, 6), SharingBlock(shared), SharingBlock(shared), nn.Linear(6, 3))
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([SharingBlock]), split_root=split_root)
    step = ff.train_step(fn, make_loss(["plain"]), ff.adamw(lr=0.05, weight_decay=0.1))
    state = step.init(ff.shard(fn.params, plan, group))
    batches = _batches(world)
    norms = []
    for b in batches:
        state, metrics = step(state, tuple(t.chunk(world)[rank] for t in b))
        norms.append(metrics["grad_norm"].item())
    full = ff.unshard(state.params)
    ref_norms, ref_params = _reference(model, make_loss(["plain"]), batches, 0.05)
    assert all(type(p) is nn.Parameter for p in model.parameters())  # the module is left as it was
    return (
        plan.unit("1.shared.weight").modules,
        max(rel(a, b) for a, b in zip(norms, ref_norms)),
        max((full[k] - v).abs().max().item() for k, v in ref_params.items()),
    )


@pytest.mark.parametrize("split_root", [False, True])
def test_a_module_shared_by_two_units_is_gathered_by_each(pool, split_root):
    for modules, norm, param in pool.run(_shared_module, split_root, world=3):
        assert modules == ("1.shared", "2.shared")  # one unit for the module's weight and bias
        assert norm < 1e-5
        assert param < 1e-5


def _plain_backward(group):
    """Plain autograd through apply_sharded: the shards' .grad is the rank-mean gradient."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = Net()
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([Block])), group)
    for t in params.values():
        t.requires_grad_(True)
    x, y = (t.chunk(world)[rank] for t in _batches(world, 1)[0])
    F.mse_loss(ff.apply_sharded(fn, params, fn.buffers, x), y).backward()
    # independent reference: this rank's full gradient, averaged over ranks by all_reduce, then sliced
    full = {k: v.detach().clone().requires_grad_() for k, v in fn.params.items()}
    F.mse_loss(fn(full, fn.buffers, x), y).backward()
    worst = 0.0
    for unit in params.plan.units:
        grads = [full[p.name].grad for p in unit.params]
        flat = torch.cat([torch.zeros(p.numel) if g is None else g.reshape(-1) for p, g in zip(unit.params, grads)])
        flat = torch.cat([flat, flat.new_zeros(unit.padded_numel(world) - unit.numel)])
        torch.distributed.all_reduce(flat, group=group)
        n = unit.shard_numel(world)
        want = flat[rank * n : (rank + 1) * n] / world
        worst = max(worst, (params[unit.name].grad - want).abs().max().item())
    return worst


def test_plain_backward_through_apply_sharded(pool):
    for world in (1, 2, 3):
        assert max(pool.run(_plain_backward, world=world)) < 1e-6


def _evaluation_forward_gathers(group):
    """A no-grad call gathers each unit once, in forward only; backward never refills it."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = Net()
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]))
    counts = []
    for names in (["plain"], ["nograd_extra", "plain"]):
        step = ff.train_step(fn, make_loss(names), ff.adamw())
        state = step.init(ff.shard(fn.params, plan, group))
        with ff.comm_log() as log:
            step(state, tuple(t.chunk(world)[rank] for t in _batches(world, 1)[0]))
        counts.append(sum(1 for c in log.records if c.op == "all_gather" and c.unit is not None))
    return counts, len(plan.units)


def test_an_evaluation_forward_gathers_each_unit_once(pool):
    for (plain, with_eval), units in pool.run(_evaluation_forward_gathers, world=2):
        assert with_eval == plain + units  # one all-gather per unit for the no-grad call, none in backward


# --- an embedding's table is not gathered again for backward, unless something reads it there ----


class _ScaledEmbedding(nn.Embedding):
    """Its own forward: the output scaled by the table's norm, which backward reads."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.weight.norm()


class _TokenNet(nn.Module):
    def __init__(self, embedding: type[nn.Embedding], checkpointed: bool = False) -> None:
        super().__init__()
        self.tok = embedding(11, 6)
        self.pos = nn.Embedding(4, 6)
        self.blocks = nn.ModuleList([Block(6), Block(6)])
        self.out = nn.Linear(6, 3)
        self.checkpointed = checkpointed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:  # the model checkpoints its token embedding: recomputed in backward
            x = torch.utils.checkpoint.checkpoint(self.tok, ids, use_reentrant=False)
        else:
            x = self.tok(ids)
        x = x + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.out(x).mean(1)


def _read_by_weight_norm(module, args, output):
    return output * module.weight.norm()


def _token_model(variant: str) -> nn.Module:
    torch.manual_seed(0)
    model = _TokenNet(_ScaledEmbedding if variant == "own_forward" else nn.Embedding, variant == "checkpointed")
    if variant == "hooked":
        model.tok.register_forward_hook(_read_by_weight_norm)
    return model


def _token_loss(model, batch):
    ids, y = batch
    return F.mse_loss(model(ids), y)


def _embedding_backward(group, variant):
    """(grad-norm and parameter differences to torch, the plan's lookup units, the units the
    second step gathers again for backward)."""
    world, rank = group.size(), group.rank()
    model = _token_model(variant)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]), split_root=True)
    step = ff.train_step(fn, _token_loss, ff.adamw(lr=0.05, weight_decay=0.1), remat=variant == "remat")
    state = step.init(ff.shard(fn.params, plan, group))
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 11, (4 * world, 4), generator=g), torch.randn(4 * world, 3, generator=g))] * 2
    norms = []
    for b in batches:
        with ff.comm_log() as log:
            state, metrics = step(state, tuple(t.chunk(world)[rank] for t in b))
        norms.append(metrics["grad_norm"].item())
    forward = len(plan.units)
    regathered = {c.unit for c in log.records[forward:] if c.op == "all_gather" and c.unit is not None}
    ref_norms, ref_params = _reference(_token_model(variant), _token_loss, batches, 0.05)
    full = ff.unshard(state.params)
    return (
        max(rel(a, b) for a, b in zip(norms, ref_norms, strict=True)),
        max((full[k] - v).abs().max().item() for k, v in ref_params.items()),
        {u.name for u in plan.units if u.lookup},
        regathered & {"tok", "pos"},
    )


@pytest.mark.parametrize(
    ("variant", "lookups", "regathered"),
    [
        ("plain", {"tok", "pos"}, set()),  # each reads only its token ids in backward
        ("own_forward", {"pos"}, {"tok"}),  # a forward of its own: not known to leave the table alone
        ("hooked", {"tok", "pos"}, {"tok"}),  # a hook of the user's reads the table in backward
        ("checkpointed", {"tok", "pos"}, {"tok"}),  # the model's checkpoint recomputes it in backward
        ("remat", {"tok", "pos"}, set()),  # train_step(remat=True) leaves lookups alone: nothing to recompute
    ],
)
def test_an_embedding_is_gathered_again_for_backward_only_when_backward_reads_it(pool, variant, lookups, regathered):
    # Catches: the table skipped by backward while something reads it there (a freed buffer
    # read, or garbage: parity fails), and a plain lookup gathered again for nothing.
    for norm, param, plan_lookups, again in pool.run(_embedding_backward, variant, world=2):
        assert norm < 1e-5, norm
        assert param < 1e-5, param
        assert plan_lookups == lookups
        assert again == regathered


# --- what a unit returns and keeps ------------------------------------------------------------------


@dataclasses.dataclass
class Hidden:
    h: torch.Tensor
    note: str = "block"


@dataclasses.dataclass(frozen=True)
class FrozenHidden:
    parts: tuple[torch.Tensor, ...]

    @property
    def h(self) -> torch.Tensor:
        return self.parts[0]


class Boxed:
    """A container of the user's own: neither a pytree node nor a dataclass."""

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


class BoxingBlock(nn.Module):
    """Returns its output inside ``box``; ``keep_aux``: also keeps an auxiliary loss on itself
    (a router's load-balancing term, read by the loss after the forward)."""

    def __init__(self, d: int, box: str, keep_aux: bool) -> None:
        super().__init__()
        self.fc, self.router = nn.Linear(d, d), nn.Linear(d, 3)
        self.box, self.keep_aux = box, keep_aux

    def forward(self, x: torch.Tensor) -> Any:
        h = x + torch.tanh(self.fc(x))
        if self.keep_aux:
            self.aux = self.router(x).softmax(-1).square().mean()
        if self.box == "dataclass":
            return Hidden(h)
        if self.box == "frozen_dataclass":
            return FrozenHidden((h, torch.sigmoid(self.router(h))))
        return Boxed(h) if self.box == "object" else h


class BoxingNet(nn.Module):
    def __init__(self, box: str, keep_aux: bool = False, checkpointed: bool = False) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(5, 6), nn.Linear(6, 3)
        self.blocks = nn.ModuleList([BoxingBlock(6, box, keep_aux) for _ in range(2)])
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            run = functools.partial(torch.utils.checkpoint.checkpoint, block, use_reentrant=False)
            x = (run(x) if self.checkpointed else block(x)).h if block.box != "tensor" else block(x)
        return self.out(x)


def _boxed_loss(module, penalty=False):
    def loss_fn(m, batch):  # (``m`` is the module itself in the reference)
        x, y = batch
        if penalty:  # a gradient penalty on the inputs: a backward inside the loss, before the step's
            x = x.detach().requires_grad_()
            out = m(x)
            (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            return F.mse_loss(out, y) + 0.1 * g.square().mean()
        loss = F.mse_loss(m(x), y)
        blocks = m.blocks if isinstance(m, nn.Module) else module.blocks
        return loss + sum(b.aux for b in blocks) if blocks[0].keep_aux else loss

    return loss_fn


def _train_boxed(group, box, remat, keep_aux=False, checkpointed=False, penalty=False):
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = BoxingNet(box, keep_aux, checkpointed)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([BoxingBlock]))
    step = ff.train_step(fn, _boxed_loss(model, penalty), ff.adamw(lr=0.05, weight_decay=0.1), remat=remat)
    state = step.init(ff.shard(fn.params, plan, group))
    batches = _batches(world)
    norms = []
    try:
        for b in batches:
            state, metrics = step(state, tuple(t.chunk(world)[rank] for t in b))
            norms.append(metrics["grad_norm"].item())
    except ff.RematError as e:
        return str(e)
    full = ff.unshard(state.params)
    for block in model.blocks:
        block.__dict__.pop("aux", None)  # (a tensor with its graph: the reference copies the model)
    ref_norms, ref_params = _reference(model, _boxed_loss(model, penalty), batches, 0.05)
    return (
        max(rel(a, b) for a, b in zip(norms, ref_norms)),
        max((full[k] - v).abs().max().item() for k, v in ref_params.items()),
        all(torch.equal(full[k], v.detach()) for k, v in model.named_parameters() if torch.equal(ref_params[k], v)),
    )


@pytest.mark.parametrize("remat", [None, True], ids=["default", "remat"])
@pytest.mark.parametrize("box", ["dataclass", "frozen_dataclass", "object"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_units_output_inside_a_container_trains_like_one_process(pool, world, box, remat):
    """A unit may return its output inside a dataclass (opened like a pytree, as torch's FSDP1
    does; before, the default step freed the unit with no refill and its backward read freed
    storage, and remat dropped the units' gradients silently) or an object of the user's own
    (which fsdp_fn cannot see into: the unit stays gathered for its backward, and for a
    backward inside the loss; under remat, whose forward runs without autograd, that would
    lose its gradient: refused, naming it)."""
    results = pool.run(_train_boxed, box, remat, world=world)
    if box == "object" and remat:
        for message in results:
            assert message.startswith("remat(blocks.0): the region's forward kept a tensor of shape"), message
            assert "neither a pytree nor a dataclass" in message
        return
    _check(results)
    if box == "object" and world > 1:  # a backward inside the loss comes before the loss is known
        _check(pool.run(_train_boxed, box, remat, penalty=True, world=world))


@pytest.mark.parametrize("how", ["remat", "torch_checkpoint"])
def test_a_tensor_a_rematerialised_unit_keeps_on_itself_is_refused(pool, how):
    """A unit that keeps an auxiliary loss on itself (``self.aux = ...``), which the loss adds:
    without remat the step is torch's; rematerialised (by the step, or by the model's own
    ``torch.utils.checkpoint``), its forward runs without autograd, so the term would carry no
    gradient: refused, naming the unit (before, the routers silently got none)."""
    _check(pool.run(_train_boxed, "tensor", None, True, world=2))
    remat, checkpointed = (True, False) if how == "remat" else (None, True)
    box = "tensor" if how == "remat" else "dataclass"
    for message in pool.run(_train_boxed, box, remat, True, checkpointed, world=2):
        assert message.startswith("remat(blocks.0): the region's forward kept a tensor of shape []"), message


class Routed(nn.Module):
    """Two experts; each row goes to ``b`` when its first feature is positive, else to ``a``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        to_b = x[:, 0] > 0
        out = torch.zeros_like(x)
        if (~to_b).any():
            out[~to_b] = self.a(x[~to_b])
        if to_b.any():
            out[to_b] = self.b(x[to_b])
        return x + out


class RoutedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Routed(), Routed()])
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _routed_loss(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def _routed(group, update_in_backward, collectives="pairwise"):
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = RoutedNet()
    rows, to_a = (8, 6) if collectives == "hybrid" else (6, 3)
    x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(1)).abs()
    # The last rows go to expert a: at W=2 rank 0's all go to b, rank 1's to a, so rank 0, which
    # holds a's shard, learns only from rank 1 that a was reached. 2x2 hybrid: rank 0 to b, ranks
    # 1-3 to a, so ranks 2 and 3 (one shard group) learn of b's rows only from the other replica.
    x[rows - to_a :, 0] = -x[rows - to_a :, 0]
    y = torch.randn(rows, 1, generator=torch.Generator().manual_seed(2))
    target: Any = group
    if collectives == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        target = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    x_rank, y_rank = x.chunk(world)[rank], y.chunk(world)[rank]
    fn = ff.functionalize(model)
    schedule = ff.Schedule(update_in_backward=update_in_backward)
    step = ff.train_step(fn, _routed_loss, ff.adamw(lr=0.05, weight_decay=0.1), schedule=schedule)
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([Routed])), target))
    norms = []
    with native_collectives(collectives == "native"):
        # every parameter is reached by the global batch, so value_and_grad marks all as received
        _, grads = ff.value_and_grad(fn, lambda m, b: F.mse_loss(m(b[0]), b[1]))(
            state.params, fn.buffers, (x_rank, y_rank)
        )
        everywhere = all(all(mask) for mask in grads.received.values())
        for _ in range(2):
            state, metrics = step(state, (x_rank, y_rank))
            norms.append(metrics["grad_norm"].item())
    full = ff.unshard(state.params)
    ref_norms, ref_params = _reference(model, _routed_loss, [(x, y)] * 2, 0.05)
    return (
        max(rel(a, b) for a, b in zip(norms, ref_norms)),
        max((full[k] - v).abs().max().item() for k, v in ref_params.items()),
        everywhere,
    )


@pytest.mark.parametrize("update_in_backward", [False, True], ids=["default", "update_in_backward"])
@pytest.mark.parametrize(
    ("world", "collectives"), [(2, "pairwise"), (3, "pairwise"), (2, "native"), (3, "native"), (4, "hybrid")]
)
def test_an_expert_only_some_ranks_route_to_is_stepped_on_every_rank(pool, world, collectives, update_in_backward):
    """A mixture-of-experts unit whose experts get rows on some ranks only: a parameter any
    rank's batch reached is stepped, as torch steps what the global batch reached. With
    ``update_in_backward`` each unit's mask is merged over the ranks (and the replicas) before
    its update (before: every rank stepped its own, and the step raised a DivergenceError after
    applying them); on the pairwise exchanges, by messages issued beside the unit's reduce-scatter."""
    _check(pool.run(_routed, update_in_backward, collectives, world=world))


def _on_native_collectives(group, names, step_kw):
    """``_run`` with the backend's own all-gather and reduce-scatter (NCCL's path; on gloo,
    ``FSDP_FN_COLLECTIVES=native``) instead of the pairwise exchanges."""
    with native_collectives():
        return _run(group, names, step_kw)


@pytest.mark.parametrize(
    "step_kw",
    [{}, {"update_in_backward": True}, {"remat": True}, {"micro_batches": 2}],
    ids=["default", "update_in_backward", "remat", "micro_batches"],
)
def test_the_backends_own_collectives_train_like_one_process(pool, step_kw):
    """Every step at W >= 2 on the backend's own collectives (the path NCCL takes) once failed
    in backward: the collective counts its output as changed in place when it completes, on
    its own thread, so a refilled unit's views looked modified to autograd ("a view created
    inside a custom Function ... has been modified inplace"). It gathers into an alias of the
    buffer's storage with a version counter of its own now."""
    for world in (2, 3):
        _check(pool.run(_on_native_collectives, ["plain", "nograd_extra", "no_head"], step_kw, world=world))
