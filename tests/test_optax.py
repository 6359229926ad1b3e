"""optax itself as the oracle: every building block, on identical parameter and gradient
sequences, at W=1 and W=2, through ``update`` + ``apply_updates`` and through the train
step's in-place form (``update_in_place``). jax runs on the CPU, inside the ranks only."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from torch import nn

import fsdp_fn as ff
from tests.helpers import MLP

STEPS = 6
TOL = {"rtol": 2e-5, "atol": 2e-6}


def _cases(optax, jnp):
    """name -> (ours, optax's, steps whose gradient is NaN everywhere, a hook after each step or None)."""
    matrix = lambda name, shape: len(shape) >= 2  # noqa: E731  (weights, not biases: splits every unit)
    sched = optax.linear_schedule(1e-2, 1e-3, 4)  # a jax schedule as ``lr``: accepted, read at the state's count

    def tree(names_shapes, fn):
        return {n: fn(n, s) for n, s in names_shapes}

    return {
        "adamw": (lambda ns: ff.adamw(lr=1e-2, weight_decay=0.1), lambda ns: optax.adamw(1e-2, weight_decay=0.1)),
        "adamw_mask_schedule": (
            lambda ns: ff.adamw(lr=sched, weight_decay=0.1, weight_decay_mask=matrix),
            lambda ns: optax.adamw(sched, weight_decay=0.1, mask=tree(ns, matrix)),
        ),
        "adam": (lambda ns: ff.adam(lr=1e-2), lambda ns: optax.adam(1e-2)),
        "sgd_momentum": (lambda ns: ff.sgd(lr=0.1, momentum=0.9), lambda ns: optax.sgd(0.1, momentum=0.9)),
        "sgd_nesterov": (
            lambda ns: ff.sgd(lr=0.1, momentum=0.9, nesterov=True),
            lambda ns: optax.sgd(0.1, momentum=0.9, nesterov=True),
        ),
        "lion": (lambda ns: ff.lion(lr=1e-3, weight_decay=0.01), lambda ns: optax.lion(1e-3, weight_decay=0.01)),
        "clip_scale": (
            lambda ns: ff.chain(ff.clip(0.05), ff.scale(-0.1)),
            lambda ns: optax.chain(optax.clip(0.05), optax.scale(-0.1)),
        ),
        "clip_by_global_norm": (
            lambda ns: ff.chain(ff.clip_by_global_norm(0.5), ff.adamw(lr=1e-2)),
            lambda ns: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=1e-2)),
        ),
        # the second clip norms what the first one returned (before: the first one's stale norm)
        "two_clips": (
            lambda ns: ff.chain(ff.scale(10.0), ff.clip_by_global_norm(2.0), ff.clip_by_global_norm(0.3), ff.sgd(0.1)),
            lambda ns: optax.chain(
                optax.scale(10.0), optax.clip_by_global_norm(2.0), optax.clip_by_global_norm(0.3), optax.sgd(0.1)
            ),
        ),
        "zero_nans": (
            lambda ns: ff.chain(ff.zero_nans(), ff.sgd(0.1)),
            lambda ns: optax.chain(optax.zero_nans(), optax.sgd(0.1)),
            {2},
        ),
        "add_decayed_weights_schedule": (
            lambda ns: ff.chain(ff.add_decayed_weights(0.5, matrix), ff.scale_by_learning_rate(sched)),
            lambda ns: optax.chain(
                optax.add_decayed_weights(0.5, tree(ns, matrix)), optax.scale_by_learning_rate(sched)
            ),
        ),
        "scale_by_adam_by_hand": (  # adamw spelled out: the pieces chain to the whole
            lambda ns: ff.chain(ff.scale_by_adam(), ff.add_decayed_weights(0.1), ff.scale_by_learning_rate(1e-2)),
            lambda ns: optax.adamw(1e-2, weight_decay=0.1),
        ),
        "masked": (
            lambda ns: ff.chain(ff.masked(ff.scale(10.0), matrix), ff.sgd(0.01)),
            lambda ns: optax.chain(optax.masked(optax.scale(10.0), tree(ns, matrix)), optax.sgd(0.01)),
        ),
        "multi_transform": (
            lambda ns: ff.multi_transform(
                {"w": ff.adamw(lr=1e-2, weight_decay=0.1), "b": ff.sgd(lr=0.1, momentum=0.5)},
                lambda n, s: "w" if matrix(n, s) else "b",
            ),
            lambda ns: optax.multi_transform(
                {"w": optax.adamw(1e-2, weight_decay=0.1), "b": optax.sgd(0.1, momentum=0.5)},
                tree(ns, lambda n, s: "w" if matrix(n, s) else "b"),
            ),
        ),
        "multi_transform_clip_one_label": (  # the clip writes into its own label's gradients only
            lambda ns: ff.multi_transform(
                {"w": ff.chain(ff.clip(0.01), ff.sgd(0.1)), "b": ff.sgd(0.1)},
                lambda n, s: "w" if matrix(n, s) else "b",
            ),
            lambda ns: optax.multi_transform(
                {"w": optax.chain(optax.clip(0.01), optax.sgd(0.1)), "b": optax.sgd(0.1)},
                tree(ns, lambda n, s: "w" if matrix(n, s) else "b"),
            ),
        ),
        "inject_hyperparams": (
            lambda ns: ff.inject_hyperparams(ff.adamw)(lr=1e-2, weight_decay=0.1),
            lambda ns: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1),
            set(),
            3,  # at step 3 both lower the learning rate through the state
        ),
        "inject_hyperparams_schedule": (
            lambda ns: ff.inject_hyperparams(ff.sgd)(lr=sched, momentum=0.9),
            lambda ns: optax.inject_hyperparams(optax.sgd)(learning_rate=sched, momentum=0.9),
        ),
        "apply_if_finite": (
            lambda ns: ff.apply_if_finite(ff.adamw(lr=sched, weight_decay=0.1), max_consecutive_errors=2),
            lambda ns: optax.apply_if_finite(optax.adamw(sched, weight_decay=0.1), max_consecutive_errors=2),
            {1, 2},  # two rejected in a row: the schedule's count does not move
        ),
        "accumulate_mean": (
            lambda ns: ff.accumulate(3, ff.adamw(lr=sched, weight_decay=0.1)),
            lambda ns: optax.MultiSteps(optax.adamw(sched, weight_decay=0.1), every_k_schedule=3),
        ),
        "accumulate_sum_every_k_schedule": (
            lambda ns: ff.accumulate(lambda k: 2 if k < 1 else 3, ff.sgd(lr=0.05, momentum=0.9), use_grad_mean=False),
            lambda ns: optax.MultiSteps(
                optax.sgd(0.05, momentum=0.9), every_k_schedule=lambda k: jnp.where(k < 1, 2, 3), use_grad_mean=False
            ),
        ),
    }


def _setup(group):
    torch.manual_seed(0)
    model = MLP()
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([nn.Linear]))
    return fn, plan, ff.shard(fn.params, plan, group)


def _gradients(fn, step, nan=False):
    g = torch.Generator().manual_seed(100 + step)
    out = {k: 0.3 * torch.randn(v.shape, generator=g) for k, v in fn.params.items()}
    if nan:
        for v in out.values():
            v.view(-1)[0] = float("nan")
    return out


def _counters(state):
    """The plain counters of a state, ours or optax's, by field name (first found)."""
    out = {}

    def walk(s):
        if hasattr(s, "_fields"):
            for name, value in zip(s._fields, s, strict=True):
                if name in ("notfinite_count", "last_finite", "total_notfinite", "mini_step", "gradient_step"):
                    out.setdefault(name, int(np.asarray(value)))
                walk(value)
        elif isinstance(s, tuple | list):
            for value in s:
                walk(value)
        elif isinstance(s, dict):
            for value in s.values():
                walk(value)

    walk(state)
    return out


def _against_optax(group, names):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import optax

    fn, plan, start = _setup(group)
    shapes = [(k, tuple(v.shape)) for k, v in fn.params.items()]
    results = {}
    for name, (ours_of, theirs_of, *extra) in _cases(optax, jnp).items():
        if name not in names:
            continue
        nans = extra[0] if extra else set()
        change_at = extra[1] if len(extra) > 1 else None
        ours, theirs = ours_of(shapes), theirs_of(shapes)
        params = ff.tree_map(torch.clone, start)
        in_place = ff.tree_map(torch.clone, start)
        state, state_ip = ours.init(params), ours.init(in_place)
        jparams = {k: jnp.asarray(v.detach().numpy()) for k, v in fn.params.items()}
        jstate = theirs.init(jparams)
        # optax's wrappers branch with lax.cond (and its norms select), which compile at every eager call: once here
        their_update = (
            jax.jit(theirs.update) if name.startswith(("apply_if", "accumulate", "clip_by", "zero")) else theirs.update
        )
        counters, untouched = [], True
        for k in range(STEPS):
            if k == change_at:  # a hyper-parameter changed through the state, as optax allows
                state = state._replace(hyperparams={**state.hyperparams, "lr": 3e-3})
                state_ip = state_ip._replace(hyperparams={**state_ip.hyperparams, "lr": 3e-3})
                jstate.hyperparams["learning_rate"] = jnp.asarray(3e-3)
            full = _gradients(fn, k, nan=k in nans)
            grads = ff.reduce_grads(full, start)  # the same on every rank: the mean is itself
            given = [t for t in ff.tree_leaves((grads, state, params)) if isinstance(t, torch.Tensor)]
            before = [t.clone() for t in given]
            updates, state = ours.update(grads, state, params)
            untouched &= all(  # functional
                torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(before, given, strict=True)
            )
            params = ff.apply_updates(params, updates)
            state_ip = ff.update_in_place(ours, grads, state_ip, in_place)
            jupdates, jstate = their_update({n: jnp.asarray(v.numpy()) for n, v in full.items()}, jstate, jparams)
            jparams = optax.apply_updates(jparams, jupdates)
            counters.append((_counters(state), _counters(state_ip), _counters(jstate)))
        got, got_ip = ff.unshard(params), ff.unshard(in_place)
        want = {n: torch.from_numpy(np.array(v)) for n, v in jparams.items()}
        moved = max((want[n] - fn.params[n].detach()).abs().max().item() for n in want)
        errors = []
        for label, tree in (("update", got), ("update_in_place", got_ip)):
            for n, w in want.items():
                if not torch.allclose(tree[n], w, **TOL):
                    errors.append(f"{label} {n}: max diff {(tree[n] - w).abs().max().item():.3g}")
        results[name] = (errors, counters, moved, untouched)
    return results


NAMES = [
    "adamw",
    "adamw_mask_schedule",
    "adam",
    "sgd_momentum",
    "sgd_nesterov",
    "lion",
    "clip_scale",
    "clip_by_global_norm",
    "two_clips",
    "zero_nans",
    "add_decayed_weights_schedule",
    "scale_by_adam_by_hand",
    "masked",
    "multi_transform",
    "multi_transform_clip_one_label",
    "inject_hyperparams",
    "inject_hyperparams_schedule",
    "apply_if_finite",
    "accumulate_mean",
    "accumulate_sum_every_k_schedule",
]


# At W=1 (no communication) a few, one of each kind; at W=2 (shards, global norms) every case.
ONE_RANK = [
    "adamw_mask_schedule",
    "lion",
    "two_clips",
    "multi_transform_clip_one_label",
    "apply_if_finite",
    "accumulate_mean",
]


@pytest.mark.parametrize("world", [1, 2])
def test_every_building_block_equals_optax(pool, world):
    # Catches: a building block whose numbers differ from optax's (a moment's bias correction, a
    # mask that misses a parameter of a split unit, a schedule read at the wrong count, a clip that
    # norms a stale gradient, a wrapper's counters), in the functional form or the step's in-place one.
    names = ONE_RANK if world == 1 else NAMES
    for results in pool.run(_against_optax, names, world=world):
        assert set(results) == set(names)
        for name, (errors, counters, moved, untouched) in results.items():
            assert not errors, (name, errors[:4])
            assert untouched, name  # update changed nothing it was given
            assert moved > 1e-4, name  # the parameters really moved
            for ours, in_place, theirs in counters:
                assert ours == in_place == theirs, (name, counters)


def _skipped_round(group):
    """``accumulate(2, apply_if_finite(adamw(lr=schedule)))`` on gradients [1, nan, 1, 1, 1, 1]:
    the first round is rejected, so the schedule reads counts 0 and 1 for the next two rounds;
    the same as optax's adamw given the two rounds' means."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp
    import optax

    fn, plan, params = _setup(group)
    sched = optax.linear_schedule(1e-2, 1e-3, 2)
    ours = ff.accumulate(2, ff.apply_if_finite(ff.adamw(lr=sched, weight_decay=0.1)))
    state = ours.init(params)
    grads = [_gradients(fn, k, nan=k == 1) for k in range(6)]
    for g in grads:
        updates, state = ours.update(ff.reduce_grads(g, params), state, params)
        params = ff.apply_updates(params, updates)
    theirs = optax.adamw(sched, weight_decay=0.1)
    jparams = {k: jnp.asarray(v.detach().numpy()) for k, v in fn.params.items()}
    jstate = theirs.init(jparams)
    for a, b in ((2, 3), (4, 5)):
        mean = {n: jnp.asarray(((grads[a][n] + grads[b][n]) / 2).numpy()) for n in grads[a]}
        jupdates, jstate = theirs.update(mean, jstate, jparams)
        jparams = optax.apply_updates(jparams, jupdates)
    got = ff.unshard(params)
    inner = state.inner_opt_state
    return (
        max((got[n] - torch.from_numpy(np.array(v))).abs().max().item() for n, v in jparams.items()),
        inner.inner_state[-1].count,  # the schedule's count: the updates adamw applied
        (state.gradient_step, inner.total_notfinite),
    )


@pytest.mark.parametrize("world", [1, 2])
def test_a_schedule_after_a_rejected_round_reads_the_updates_applied(pool, world):
    # Catches: the schedule reading the calls' or the rounds' count (before: grads.step // k, which
    # counted the rejected round: steps 1, 2 where adamw applied steps 0, 1).
    for diff, count, rounds in pool.run(_skipped_round, world=world):
        assert diff < 2e-6 and count == 2 and rounds == (3, 1)


def test_defaults_that_differ_from_optax_are_torchs():
    # docs/api.md lists them: AdamW's weight decay 1e-2 (optax 1e-4), SGD's lr 1e-2, Adam's L2 decay.
    import inspect

    assert inspect.signature(ff.adamw).parameters["weight_decay"].default == 1e-2
    assert inspect.signature(ff.adam).parameters["weight_decay"].default == 0.0
    assert math.isclose(inspect.signature(ff.adamw).parameters["eps"].default, 1e-8)


def _too_many_errors(group):
    """``max_consecutive_errors=1``: a second non-finite gradient in a row is applied, as optax does."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp
    import optax

    fn, plan, params = _setup(group)
    ours = ff.apply_if_finite(ff.scale(-0.1), max_consecutive_errors=1)
    theirs = optax.apply_if_finite(optax.scale(-0.1), max_consecutive_errors=1)
    state, jstate = ours.init(params), theirs.init({k: jnp.asarray(v.detach().numpy()) for k, v in fn.params.items()})
    seen = []
    for k, nan in enumerate((True, True, False, True)):
        full = _gradients(fn, k, nan=nan)
        updates, state = ours.update(ff.reduce_grads(full, params), state, params)
        _, jstate = theirs.update({n: jnp.asarray(v.numpy()) for n, v in full.items()}, jstate)
        applied = any(bool(torch.isnan(t).any()) or bool(t.abs().sum() > 0) for t in updates.values())
        seen.append((ours.outcome(state).value, applied, _counters(state) == _counters(jstate)))
    return seen


def test_apply_if_finite_applies_after_max_consecutive_errors_as_optax(pool):
    (seen,) = pool.run(_too_many_errors, world=1)
    assert seen == [
        ("rejected", False, True),
        ("applied", True, True),
        ("applied", True, True),
        ("rejected", False, True),
    ]


# --- one transformation value, many trees; NaN, dtypes and wrappers as optax has them (issue 44) ---


class _Tree(nn.Module):
    """A module holding only the parameters named, in that order: one unit (the root)."""

    def __init__(self, shapes, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(len(shapes))
        for n, s in shapes:
            self.register_parameter(n, nn.Parameter(torch.randn(s, generator=g).to(dtype)))

    def forward(self, x):
        return x


def _grads_of(params, step, scale=0.3):
    g = torch.Generator().manual_seed(200 + step)
    return {n: scale * torch.randn(v.shape, generator=g).to(v.dtype) for n, v in params.items()}


def _ours_and_optax(
    group,
    ours,
    theirs,
    shapes,
    *,
    steps=3,
    grads=_grads_of,
    dtype=torch.float32,
    extra=None,
    change=None,
    grad_dtype=None,
    widened=False,
    jit=False,
):
    """``ours`` and optax's ``theirs`` from the same parameters on the same gradients (the full
    ones to optax, reduced to the shards for ours), through ``update`` + ``apply_updates`` and
    through ``update_in_place``; ``change(k, ours_state, optax_state)`` before step ``k`` returns
    the states to go on with; ``grad_dtype``: the gradients in that dtype (both sides; with
    ``widened``, optax gets the same values as float32); ``jit``: optax's update compiled once
    (a wrapper's ``lax.cond`` otherwise compiles at every eager call). Returns the unsharded
    parameters of both forms and optax's."""
    import jax
    import jax.numpy as jnp
    import optax

    model = _Tree(shapes, dtype)
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model), group)
    in_place = ff.tree_map(torch.clone, params)
    state, state_ip = ours.init(params), ours.init(in_place)
    tonp = lambda t: jnp.asarray(t.detach().float().numpy()).astype(jnp.bfloat16 if t.dtype == torch.bfloat16 else None)  # noqa: E731
    jparams = {n: tonp(v) for n, v in fn.params.items()}
    jstate = theirs.init(jparams)
    their_update = jax.jit(theirs.update) if jit else theirs.update
    for k in range(steps):
        if change is not None:
            state, jstate = change(k, state, jstate)
            state_ip, _ = change(k, state_ip, None)
        full = grads(fn.params, k)
        if grad_dtype is not None:
            full = {n: v.to(grad_dtype) for n, v in full.items()}
        g = _cast(ff.reduce_grads(full, params), grad_dtype)
        updates, state = ours.update(g, state, params, **(extra or {}))
        params = ff.apply_updates(params, updates)
        state_ip = ff.update_in_place(ours, _cast(ff.reduce_grads(full, params), grad_dtype), state_ip, in_place)
        jgrads = {n: tonp(v.float() if widened else v) for n, v in full.items()}
        jupdates, jstate = their_update(jgrads, jstate, jparams, **(extra or {}))
        jparams = optax.apply_updates(jparams, jupdates)
    want = {n: torch.from_numpy(np.array(v.astype(jnp.float32))) for n, v in jparams.items()}
    return (
        {n: v.float() for n, v in ff.unshard(params).items()},
        {n: v.float() for n, v in ff.unshard(in_place).items()},
        want,
    )


def _cast(grads, dtype):
    return grads if dtype is None else grads.replace({u: t.to(dtype) for u, t in grads.shards.items()})


def _off(got, want):
    """The largest difference, NaN where both are NaN counting as equal (inf: NaN in one only)."""
    out = 0.0
    for n, w in want.items():
        g = got[n]
        if not torch.equal(g.isnan(), w.isnan()):
            return math.inf
        keep = ~w.isnan()
        out = max(out, (g[keep] - w[keep]).abs().max().item() if keep.any() else 0.0)
    return out


def _matrix_tree(jax):
    return lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)


def _reused_cases(jax, optax):
    matrix = lambda n, s: len(s) >= 2  # noqa: E731
    tree = _matrix_tree(jax)
    labels = lambda p: jax.tree.map(lambda x: "w" if x.ndim >= 2 else "b", p)  # noqa: E731
    return {
        "masked": (ff.masked(ff.scale(-1.0), matrix), optax.masked(optax.scale(-1.0), tree)),
        "multi_transform": (
            ff.multi_transform(
                {"w": ff.sgd(0.1, momentum=0.9), "b": ff.scale(-0.5)}, lambda n, s: "w" if matrix(n, s) else "b"
            ),
            optax.multi_transform({"w": optax.sgd(0.1, momentum=0.9), "b": optax.scale(-0.5)}, labels),
        ),
        "add_decayed_weights": (
            ff.chain(ff.add_decayed_weights(0.5, matrix), ff.scale(-0.1)),
            optax.chain(optax.add_decayed_weights(0.5, tree), optax.scale(-0.1)),
        ),
        "adamw": (
            ff.adamw(1e-2, weight_decay=0.5, weight_decay_mask=matrix),
            optax.adamw(1e-2, weight_decay=0.5, mask=tree),
        ),
        "adam": (
            ff.adam(1e-2, weight_decay=0.5, weight_decay_mask=matrix),
            optax.chain(optax.add_decayed_weights(0.5, tree), optax.adam(1e-2)),
        ),
        "sgd": (
            ff.sgd(0.1, momentum=0.9, weight_decay=0.5, weight_decay_mask=matrix),
            optax.chain(optax.add_decayed_weights(0.5, tree), optax.sgd(0.1, momentum=0.9)),
        ),
        "lion": (
            ff.lion(1e-2, weight_decay=0.5, weight_decay_mask=matrix),
            optax.lion(1e-2, weight_decay=0.5, mask=tree),
        ),
    }


def _reused(group):
    """Each value used on a tree ``w1 (2, 2), b1 (4,)`` and then on ``b2 (4,), w2 (2, 2)``: one unit
    of the same name, its parameters in the other order."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import optax

    out = {}
    for name, (ours, theirs) in _reused_cases(jax, optax).items():
        offs = []
        for shapes in ([("w1", (2, 2)), ("b1", (4,))], [("b2", (4,)), ("w2", (2, 2))]):
            got, got_ip, want = _ours_and_optax(group, ours, theirs, shapes)
            offs.append((_off(got, want), _off(got_ip, want)))
        out[name] = offs
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_transformation_value_used_on_a_second_tree_applies_that_trees_masks(pool, world):
    # Catches: masks cached by unit name (before: the second tree's root unit got the first's
    # masks, so masked negated b2 and left w2, the decay went to the bias).
    for results in pool.run(_reused, world=world):
        assert set(results) == {"masked", "multi_transform", "add_decayed_weights", "adamw", "adam", "sgd", "lion"}
        for name, offs in results.items():
            assert all(a < 2e-6 and b < 2e-6 for a, b in offs), (name, offs)


def _nan_at(step, name, index=0):
    """Gradients with one NaN element: parameter ``name``'s ``index`` at ``step``."""

    def grads(params, k):
        out = _grads_of(params, k)
        if k == step:
            out[name].view(-1)[index] = float("nan")
        return out

    return grads


def _lion_nan(group):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import optax

    shapes = [("w", (3, 4)), ("b", (5,))]
    got, got_ip, want = _ours_and_optax(
        group, ff.lion(1e-2, weight_decay=0.1), optax.lion(1e-2, weight_decay=0.1), shapes, grads=_nan_at(1, "w", 2)
    )
    return _off(got, want), _off(got_ip, want), int(want["w"].isnan().sum())


@pytest.mark.parametrize("world", [1, 2])
def test_lion_on_a_nan_gradient_gives_nan_as_optax(pool, world):
    # Catches: torch.sign(nan) == 0 (before: the element stopped moving for good while its moment
    # stayed NaN; optax's jnp.sign gives NaN, so the parameter is NaN and apply_if_finite sees it).
    for off, off_ip, nans in pool.run(_lion_nan, world=world):
        assert nans == 1  # optax: exactly the element whose gradient was NaN
        assert off < 2e-6 and off_ip < 2e-6, (off, off_ip)


def _bf16_round(group, accumulator_dtype):
    """64 bf16 micro-gradients of a 1024-element bf16 weight through ``accumulate(64, scale(-1))``
    and optax's ``MultiSteps`` (float32 accumulator by default): the elements each ends off
    ``p - mean`` with the exact mean rounded to bf16 once, and off each other."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp
    import optax

    shapes = [("w", (1024,))]
    kw = {} if accumulator_dtype == "default" else {"accumulator_dtype": accumulator_dtype}
    ours = ff.accumulate(64, ff.scale(-1.0), **kw)
    theirs = optax.MultiSteps(
        optax.scale(-1.0), 64, **({} if accumulator_dtype == "default" else {"accumulator_dtype": jnp.bfloat16})
    )
    got, got_ip, want = _ours_and_optax(group, ours, theirs, shapes, steps=64, dtype=torch.bfloat16, jit=True)
    start = _Tree(shapes, torch.bfloat16).w.detach()
    mean = torch.stack([_grads_of({"w": start}, k)["w"].double() for k in range(64)]).mean(0)
    exact = (start.double() - mean.bfloat16().double()).bfloat16().float()
    off = lambda t: int((t["w"] != exact).sum())  # noqa: E731
    return off(got), off(got_ip), off(want), int((got["w"] != want["w"]).sum())


@pytest.mark.parametrize("world", [1, 2])
def test_accumulate_keeps_a_float32_accumulator_as_optax_multisteps(pool, world):
    # Catches: the accumulator kept in the gradients' dtype (before: bf16, 837 of 1024 elements off
    # the once-rounded exact mean, where optax's float32 accumulator is off in 1).
    for ours, ours_ip, theirs, between in pool.run(_bf16_round, "default", world=world):
        assert theirs <= 2 and ours <= 2 and ours_ip <= 2 and between <= 2, (ours, ours_ip, theirs, between)
    # accumulator_dtype=torch.bfloat16 is optax's accumulator_dtype=jnp.bfloat16: both lose the low bits
    for ours, ours_ip, theirs, _ in pool.run(_bf16_round, torch.bfloat16, world=world):
        assert ours > 100 and ours_ip > 100 and theirs > 100, (ours, ours_ip, theirs)


def _nan_round(group):
    """A NaN in the first round's gradients: optax's accumulator, multiplied by zero at the round's
    end, stays NaN in the next round; fsdp_fn's is set to zero (the kept meaning, docs/api.md)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import optax

    shapes = [("w", (3, 4)), ("b", (5,))]
    got, got_ip, want = _ours_and_optax(
        group,
        ff.accumulate(2, ff.sgd(0.1)),
        optax.MultiSteps(optax.sgd(0.1), 2),
        shapes,
        steps=4,
        grads=_nan_at(0, "w", 1),
    )
    return [int(t["w"].isnan().sum()) for t in (got, got_ip, want)]


def test_accumulate_sets_its_accumulator_to_zero_at_a_rounds_end_where_optax_multiplies(pool):
    for ours, ours_ip, theirs in pool.run(_nan_round, world=2):
        assert (ours, ours_ip) == (1, 1)  # the NaN round's element only, once
        assert theirs == 1  # optax: the same element, and its accumulator is NaN from then on


def test_accumulate_refuses_an_accumulator_dtype_that_is_not_floating():
    with pytest.raises(
        TypeError, match=r"accumulate: accumulator_dtype must be a floating torch.dtype or None, got torch.int32"
    ):
        ff.accumulate(2, ff.sgd(), accumulator_dtype=torch.int32)


def _frozen_by(group, how):
    """``b`` frozen inside ``multi_transform``, its gradient inf at step 0 and NaN at step 1."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import optax

    def grads(params, k):
        out = _grads_of(params, k)
        if k < 2:
            out["b"].view(-1)[1] = (math.inf, math.nan)[k]
        return out

    labels = lambda p: jax.tree.map(lambda x: "w" if x.ndim >= 2 else "b", p)  # noqa: E731
    frozen = (ff.set_to_zero(), optax.set_to_zero()) if how == "set_to_zero" else (ff.scale(0.0), optax.scale(0.0))
    ours = ff.multi_transform({"w": ff.sgd(0.1), "b": frozen[0]}, lambda n, s: "w" if len(s) >= 2 else "b")
    theirs = optax.multi_transform({"w": optax.sgd(0.1), "b": frozen[1]}, labels)
    shapes = [("w", (3, 4)), ("b", (5,))]
    got, got_ip, want = _ours_and_optax(group, ours, theirs, shapes, grads=grads)
    start = _Tree(shapes).b.detach()
    return _off(got, want), _off(got_ip, want), torch.equal(got["b"], start), int(want["b"].isnan().sum())


@pytest.mark.parametrize("world", [1, 2])
def test_set_to_zero_freezes_through_inf_and_nan_as_optax(pool, world):
    # Catches: freezing by scale(0.0), the docs' idiom before, which turns an inf or NaN gradient
    # into a NaN parameter (0 * inf); optax's set_to_zero leaves it, and so does ff.set_to_zero.
    for off, off_ip, unchanged, nans in pool.run(_frozen_by, "set_to_zero", world=world):
        assert off == 0 and off_ip == 0 and unchanged and nans == 0, (off, off_ip, unchanged, nans)
    for off, off_ip, unchanged, nans in pool.run(_frozen_by, "scale", world=world):
        assert off == 0 and off_ip == 0 and not unchanged and nans == 1  # NaN, the same in optax


def _mapping_names(group):
    """A mapping by name with a key no parameter has, and one that lacks a parameter: optax's
    init raises on both (a tree of another structure); so does ours, naming the key."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp
    import optax

    model = _Tree([("w", (2, 2)), ("b", (4,))])
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model), group)
    jparams = {n: jnp.asarray(v.detach().numpy()) for n, v in fn.params.items()}
    extra, lacking = {"w": True, "b": False, "head.w": True}, {"w": True}
    cases = {
        "masked_extra": (lambda: ff.masked(ff.scale(1.0), extra), lambda: optax.masked(optax.scale(1.0), extra)),
        "masked_lacking": (lambda: ff.masked(ff.scale(1.0), lacking), lambda: optax.masked(optax.scale(1.0), lacking)),
        "multi_transform_extra": (
            lambda: ff.multi_transform({"a": ff.scale(1.0)}, {"w": "a", "b": "a", "head.w": "a"}),
            lambda: optax.multi_transform({"a": optax.scale(1.0)}, {"w": "a", "b": "a", "head.w": "a"}),
        ),
    }
    out = {}
    for name, (ours, theirs) in cases.items():
        raised = []
        for make, p in ((ours, params), (theirs, jparams)):
            try:
                make().init(p)
                raised.append(None)
            except (KeyError, ValueError) as e:
                raised.append(f"{type(e).__name__}: {e}")
        out[name] = raised
    return out


def test_a_mapping_naming_a_parameter_that_does_not_exist_raises_at_init_as_optax(pool):
    # Catches: a mask or label mapping with a key no parameter has accepted silently (before: the
    # key was ignored; optax's init raises).
    (out,) = pool.run(_mapping_names, world=1)
    for name, (ours, theirs) in out.items():
        assert ours is not None and theirs is not None, (name, ours, theirs)
    assert "masked: the mapping names 'head.w', which is no parameter of the plan" in out["masked_extra"][0]
    assert "multi_transform: the mapping names 'head.w'" in out["multi_transform_extra"][0]
    assert "masked: parameter 'b' is not in the mapping" in out["masked_lacking"][0]


def _set(at, values, theirs=None, link=None):
    """A ``change`` that sets hyper-parameters through both states at step ``at``: in the state
    itself, or in a chain's link ``link``; optax's by ``theirs`` names (``values``' by default)."""

    def put(state, fn):
        return fn(state) if link is None else (*state[:link], fn(state[link]), *state[link + 1 :])

    def change(k, state, jstate):
        if k != at:
            return state, jstate
        state = put(state, lambda s: s._replace(hyperparams={**s.hyperparams, **values}))
        if jstate is not None:
            import jax.numpy as jnp

            inner = jstate if link is None else jstate[link]
            for name, v in (theirs or values).items():
                inner.hyperparams[name] = jnp.asarray(v, dtype=inner.hyperparams[name].dtype)
        return state, jstate

    return change


def _injected(group):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import optax

    tree = _matrix_tree(jax)
    matrix = lambda n, s: len(s) >= 2  # noqa: E731
    cases = {  # name: (ours, optax's, change)
        "clip_by_global_norm_positional": (
            ff.chain(ff.inject_hyperparams(ff.clip_by_global_norm)(0.1), ff.sgd(0.1)),
            optax.chain(optax.inject_hyperparams(optax.clip_by_global_norm)(0.1), optax.sgd(0.1)),
            _set(1, {"max_norm": 0.02}, link=0),
        ),
        "scale_by_adam_defaults": (
            ff.chain(ff.inject_hyperparams(ff.scale_by_adam)(), ff.scale(-1e-2)),
            optax.chain(optax.inject_hyperparams(optax.scale_by_adam)(), optax.scale(-1e-2)),
            _set(1, {"b1": 0.5}, link=0),
        ),
        "scale_positional_schedule": (
            ff.inject_hyperparams(ff.scale)(lambda c: -0.1 * (c + 1)),
            optax.inject_hyperparams(optax.scale)(lambda c: -0.1 * (c + 1)),
            None,
        ),
        "adamw_static_mask": (
            ff.inject_hyperparams(ff.adamw, static_args="weight_decay_mask")(
                lr=1e-2, weight_decay=0.5, weight_decay_mask=matrix
            ),
            optax.inject_hyperparams(optax.adamw, static_args="mask")(learning_rate=1e-2, weight_decay=0.5, mask=tree),
            _set(1, {"weight_decay": 0.1}),
        ),
        # item 8: the chain's structure does not depend on momentum's value
        "sgd_momentum_set_to_zero": (
            ff.inject_hyperparams(ff.sgd)(lr=0.1, momentum=0.9),
            optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9),
            _set(1, {"momentum": 0.0}),
        ),
        "sgd_momentum_scheduled_from_zero": (
            ff.inject_hyperparams(ff.sgd)(lr=0.1, momentum=lambda c: 0.0 if c < 2 else 0.9),
            optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=lambda c: 0.0 if c < 2 else 0.9),
            None,
        ),
    }
    shapes = [("w", (3, 4)), ("b", (5,))]
    out = {}
    for name, (ours, theirs, change) in cases.items():
        got, got_ip, want = _ours_and_optax(group, ours, theirs, shapes, steps=4, change=change)
        out[name] = (_off(got, want), _off(got_ip, want))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_inject_hyperparams_injects_every_numeric_argument_as_optax(pool, world):
    # Catches: only the keyword arguments injected (before: inject_hyperparams(clip_by_global_norm)(0.1)
    # had hyperparams == {} and max_norm set through the state was ignored; scale_by_adam's b1 too;
    # a positional schedule was passed as the step size itself), and sgd's chain changing its links
    # when momentum is set to 0 (before: "zip() argument 2 is longer").
    for results in pool.run(_injected, world=world):
        for name, (off, off_ip) in results.items():
            assert off < 2e-6 and off_ip < 2e-6, (name, off, off_ip)


def _ignored_settings(group):
    """Setting through the state what would be ignored: a name not injected, a scheduled one."""
    model = _Tree([("w", (2, 2))])
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model), group)
    grads = ff.reduce_grads(_grads_of(fn.params, 0), params)
    out = []
    for tx, values in (
        (ff.inject_hyperparams(ff.adamw)(lr=1e-2), {"maximize": True}),
        (ff.inject_hyperparams(ff.adamw)(lr=1e-2), {"learning_rate": 1e-3}),
        (ff.inject_hyperparams(ff.sgd)(lr=lambda c: 0.1), {"lr": 0.5}),
    ):
        state = tx.init(params)
        state = state._replace(hyperparams={**state.hyperparams, **values})
        try:
            tx.update(grads, state, params)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out, sorted(ff.inject_hyperparams(ff.adamw)().init(params).hyperparams)


def test_inject_hyperparams_refuses_a_setting_it_would_ignore(pool):
    # Catches: a hyper-parameter set in the state that is not injected (or is scheduled) ignored.
    ((errors, injected),) = pool.run(_ignored_settings, world=1)
    assert injected == ["eps", "lr", "weight_decay"]  # betas (a tuple), the mask, maximize: static
    assert "state.hyperparams sets 'maximize', which is not an injected hyper-parameter" in errors[0]
    assert "sets 'learning_rate', which is not an injected hyper-parameter" in errors[1]
    assert "injected: ['eps', 'lr', 'weight_decay']" in errors[1]
    assert "sets 'lr' to 0.5, but 'lr' is scheduled" in errors[2]


def test_inject_hyperparams_static_args_must_be_arguments():
    with pytest.raises(ValueError, match=r"static_args \['mask'\] are not arguments of 'adamw'"):
        ff.inject_hyperparams(ff.adamw, static_args="mask")


def _other_grad_dtype(group):
    """bf16 gradients of float32 parameters: optax promotes (jax's rules); so do ours."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp
    import optax

    cases = {  # name: (ours, optax's, tolerance)
        "adamw": (ff.adamw(1e-2, weight_decay=0.1), optax.adamw(1e-2, weight_decay=0.1), 2e-6),
        "adam": (ff.adam(1e-2), optax.adam(1e-2), 2e-6),
        "adamw_mu_dtype": (  # mu rounded to bf16 each step on both sides: a rounding may differ
            ff.adamw(1e-2, weight_decay=0.1, mu_dtype=torch.bfloat16),
            optax.adamw(1e-2, weight_decay=0.1, mu_dtype=jnp.bfloat16),
            2e-4,
        ),
        "sgd": (ff.sgd(0.1, momentum=0.9), optax.sgd(0.1, momentum=0.9), 2e-6),
        "lion": (ff.lion(1e-2), optax.lion(1e-2), 2e-6),
    }
    shapes = [("w", (3, 4)), ("b", (5,))]
    out = {}
    for name, (ours, theirs, tol) in cases.items():
        got, got_ip, want = _ours_and_optax(group, ours, theirs, shapes, grad_dtype=torch.bfloat16, widened=True)
        # optax on the bf16 gradients themselves multiplies them by its python-float betas in bf16
        # (jax's weak types) before the moments widen them: within bf16's rounding of the products
        _, _, loose = _ours_and_optax(group, ours, theirs, shapes, grad_dtype=torch.bfloat16)
        out[name] = (_off(got, want), _off(got_ip, want), tol, _off(got, loose))
    mu = ff.adamw(mu_dtype=torch.bfloat16).init(
        ff.shard(ff.functionalize(_Tree(shapes)).params, ff.make_plan(_Tree(shapes)), group)
    )
    return out, str(mu[0].mu[""].dtype)


@pytest.mark.parametrize("world", [1, 2])
def test_gradients_in_another_dtype_than_the_parameters_as_optax(pool, world):
    # Catches: adam/adamw failing inside torch.lerp on bf16 gradients of float32 parameters (sgd,
    # trace and lion took them), and mu_dtype not kept.
    for results, mu in pool.run(_other_grad_dtype, world=world):
        assert mu == "torch.bfloat16"
        for name, (off, off_ip, tol, loose) in results.items():
            assert off < tol and off_ip < tol and loose < 3e-4, (name, off, off_ip, loose)


def _cast_before_adding(group):
    """bf16 parameters, float32 updates: fsdp_fn casts the update to bf16 and adds (a rounding of
    the update, then of the sum, as torch's ``p.add_(u)``); optax adds in float32 and casts the sum."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp
    import optax

    model = _Tree([("w", (4096,))], torch.bfloat16)
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model), group)  # W=1: the shard is the whole weight
    u = 1e-2 * torch.randn(4096, generator=torch.Generator().manual_seed(3))
    updates = params.replace({"": u})  # float32 updates of bf16 parameters
    got = ff.unshard(ff.apply_updates(params, updates))["w"]
    p = fn.params["w"].detach()
    cast_first = p + u.bfloat16()
    theirs = optax.apply_updates(
        {"w": jnp.asarray(p.float().numpy()).astype(jnp.bfloat16)}, {"w": jnp.asarray(u.numpy())}
    )
    theirs = torch.from_numpy(np.array(theirs["w"].astype(jnp.float32))).bfloat16()
    return got.dtype == torch.bfloat16, bool(torch.equal(got, cast_first)), int((got != theirs).sum())


def test_apply_updates_casts_the_update_to_the_parameters_dtype_before_adding(pool):
    # The kept meaning (docs/api.md): the update is cast to the parameters' dtype, then added, as
    # torch's in-place p.add_(u) on a bf16 p; optax adds in the wider dtype and casts the sum.
    ((bf16, cast_first, differ),) = pool.run(_cast_before_adding, world=1)
    assert bf16 and cast_first
    assert 0 < differ < 4096 // 4  # a few elements round otherwise than optax's (p + u).astype(bf16)


def _clip_at_the_norm(group):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp
    import optax

    model = _Tree([("w", (4,))])
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model), group)
    g = torch.tensor([1.2, 0.0, -1.6, 0.0])  # norm 2, exactly max_norm
    ours, _ = ff.clip_by_global_norm(2.0).update(ff.reduce_grads({"w": g}, params), ff.EmptyState(), params)
    theirs, _ = optax.clip_by_global_norm(2.0).update({"w": jnp.asarray(g.numpy())}, optax.EmptyState())
    return ff.unshard(params.replace(dict(ours.shards)))["w"], torch.from_numpy(np.array(theirs["w"])), g


def test_clip_by_global_norm_keeps_torchs_epsilon_where_optax_has_none(pool):
    # The kept meaning (docs/api.md): torch's clip_grad_norm_ coefficient max / (norm + 1e-6).
    ((ours, theirs, g),) = pool.run(_clip_at_the_norm, world=1)
    assert torch.equal(theirs, g)  # optax: a norm at max is not clipped
    coef = torch.clamp(2.0 / (torch.tensor(2.0, dtype=torch.float64).float() + 1e-6), max=1.0)
    assert torch.equal(ours, g * coef) and not torch.equal(ours, g)


def _frozen_unit(group):
    """A unit whose parameters are all frozen: ``reduce_grads`` over the plan, then adamw, as optax's
    adamw on the trainable parameters."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp
    import optax

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[1].requires_grad_(False)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([nn.Linear]))
    params = ff.shard(fn.params, plan, group)
    trainable = {n: v for n, v in fn.params.items() if n.startswith("0.")}
    ours, theirs = ff.adamw(1e-2, weight_decay=0.1), optax.adamw(1e-2, weight_decay=0.1)
    state = ours.init(params)
    jparams = {n: jnp.asarray(v.detach().numpy()) for n, v in trainable.items()}
    jstate = theirs.init(jparams)
    with ff.comm_log() as log:
        grads = ff.reduce_grads(_grads_of(trainable, 0), params)
    for k in range(3):
        full = _grads_of(trainable, k)
        updates, state = ours.update(ff.reduce_grads(full, params), state, params)
        params = ff.apply_updates(params, updates)
        jupdates, jstate = theirs.update({n: jnp.asarray(v.numpy()) for n, v in full.items()}, jstate, jparams)
        jparams = optax.apply_updates(jparams, jupdates)
    got = ff.unshard(params)
    off = max((got[n] - torch.from_numpy(np.array(v))).abs().max().item() for n, v in jparams.items())
    frozen_same = all(torch.equal(got[n], fn.params[n].detach()) for n in fn.params if n.startswith("1."))
    return off, frozen_same, tuple(grads["1"].shape), len([r for r in log.records if r.op == "reduce_scatter"])


@pytest.mark.parametrize("world", [1, 2])
def test_reduce_grads_over_a_unit_of_frozen_parameters_alone(pool, world):
    # Catches: torch.cat() of no pieces for a unit whose parameters are all frozen (before:
    # "expected a non-empty list of Tensors"; value_and_grad handled the same unit).
    for off, frozen_same, shape, scatters in pool.run(_frozen_unit, world=world):
        assert off < 2e-6 and frozen_same and shape == (0,), (off, frozen_same, shape)
        assert scatters == (1 if world > 1 else scatters)  # one unit reduced, the frozen one not


def _without_params(group):
    """``update(g, state)`` without params, as optax runs ``sgd`` and ``adam``; a link that reads
    the parameters (a weight decay) still asks for them."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp
    import optax

    model = _Tree([("w", (3, 4)), ("b", (5,))])
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model), group)
    jparams = {n: jnp.asarray(v.detach().numpy()) for n, v in fn.params.items()}
    out = {}
    for name, ours, theirs in (
        ("sgd", ff.sgd(0.1, momentum=0.9), optax.sgd(0.1, momentum=0.9)),
        ("adam", ff.adam(1e-2), optax.adam(1e-2)),
        ("sgd_plain", ff.sgd(0.1), optax.sgd(0.1)),
    ):
        state, jstate, off = ours.init(params), theirs.init(jparams), 0.0
        for k in range(3):
            full = _grads_of(fn.params, k)
            updates, state = ours.update(ff.reduce_grads(full, params), state)  # no params
            jupdates, jstate = theirs.update({n: jnp.asarray(v.numpy()) for n, v in full.items()}, jstate)
            got = ff.unshard(params.replace(dict(updates.shards)))
            off = max(
                off, max((got[n] - torch.from_numpy(np.array(v))).abs().max().item() for n, v in jupdates.items())
            )
        out[name] = off
    try:
        ff.adamw().update(ff.reduce_grads(_grads_of(fn.params, 0), params), ff.adamw().init(params))
        out["adamw"] = None
    except ValueError as e:
        out["adamw"] = str(e)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_sgd_and_adam_update_without_params_as_optax(pool, world):
    # Catches: adam's and sgd's add_decayed_weights(0) demanding params it does not read.
    for out in pool.run(_without_params, world=world):
        assert out["adamw"] == "add_decayed_weights needs params: update(grads, state, params)"
        for name in ("sgd", "adam", "sgd_plain"):
            assert out[name] < 2e-6, (name, out[name])


def _scale_by_value_ours():
    """A link of one's own that reads an extra argument, as optax's reduce_on_plateau reads ``value``."""

    def update(grads, state, params=None, *, value):
        return grads.replace({u: t * float(value) for u, t in grads.shards.items()}), state

    return ff.GradientTransformation(lambda params: ff.EmptyState(), update, "scale_by_value")


def _scale_by_value_optax(optax):
    import jax

    def update(updates, state, params=None, *, value, **extra):
        return jax.tree.map(lambda u: u * value, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def _extra_args(group):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import optax

    matrix = lambda n, s: len(s) >= 2  # noqa: E731
    tree = _matrix_tree(jax)
    mine, theirs = _scale_by_value_ours, lambda: _scale_by_value_optax(optax)
    cases = {
        "chain": (ff.chain(mine(), ff.sgd(0.1, momentum=0.9)), optax.chain(theirs(), optax.sgd(0.1, momentum=0.9))),
        "masked": (
            ff.chain(ff.masked(mine(), matrix), ff.adam(1e-2)),
            optax.chain(optax.masked(theirs(), tree), optax.adam(1e-2)),
        ),
        "accumulate": (
            ff.accumulate(2, ff.chain(mine(), ff.sgd(0.1))),
            optax.MultiSteps(optax.chain(theirs(), optax.sgd(0.1)), 2),
        ),
        "apply_if_finite": (
            ff.apply_if_finite(ff.chain(mine(), ff.sgd(0.1))),
            optax.apply_if_finite(optax.chain(theirs(), optax.sgd(0.1)), 3),
        ),
        "inject_hyperparams": (
            ff.chain(mine(), ff.inject_hyperparams(ff.sgd)(lr=0.1)),
            optax.chain(theirs(), optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)),
        ),
        "multi_transform": (
            ff.multi_transform(
                {"w": ff.chain(mine(), ff.sgd(0.1)), "b": ff.sgd(0.1)}, lambda n, s: "w" if matrix(n, s) else "b"
            ),
            optax.multi_transform(
                {"w": optax.chain(theirs(), optax.sgd(0.1)), "b": optax.sgd(0.1)},
                lambda p: jax.tree.map(lambda x: "w" if x.ndim >= 2 else "b", p),
            ),
        ),
    }
    shapes = [("w", (3, 4)), ("b", (5,))]
    out = {}
    for name, (ours, opt) in cases.items():
        got, got_ip, want = _ours_and_optax_extra(group, ours, opt, shapes)
        out[name] = _off(got, want)
    return out


def _ours_and_optax_extra(group, ours, theirs, shapes, steps=4):
    """``update(g, s, p, value=loss)`` on both sides, the loss another number at each step."""
    import jax.numpy as jnp
    import optax

    model = _Tree(shapes)
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model), group)
    state = ours.init(params)
    jparams = {n: jnp.asarray(v.detach().numpy()) for n, v in fn.params.items()}
    jstate = theirs.init(jparams)
    for k in range(steps):
        full, value = _grads_of(fn.params, k), 0.5 + 0.25 * k
        updates, state = ours.update(ff.reduce_grads(full, params), state, params, value=value)
        params = ff.apply_updates(params, updates)
        jgrads = {n: jnp.asarray(v.numpy()) for n, v in full.items()}
        jupdates, jstate = theirs.update(jgrads, jstate, jparams, value=value)
        jparams = optax.apply_updates(jparams, jupdates)
    return ff.unshard(params), None, {n: torch.from_numpy(np.array(v)) for n, v in jparams.items()}


@pytest.mark.parametrize("world", [1, 2])
def test_extra_arguments_reach_the_links_that_take_them_as_optax(pool, world):
    # Catches: update(g, s, p, value=loss) refused (before: chain's update took no extra argument),
    # or handed to a link that takes none (sgd, adam), or dropped by a wrapper.
    for out in pool.run(_extra_args, world=world):
        for name, off in out.items():
            assert off < 2e-6, (name, off)


def _no_trainable(group, kind):
    """optax's test_empty: masked and multi_transform over a tree with no parameter to train (a
    model whose parameters are all frozen: the plan's units hold none in their gradient buffer;
    or a module without any parameter: a plan of no unit, as FSDP2 accepts such a module)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import optax

    torch.manual_seed(0)
    if kind == "frozen":
        model: nn.Module = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).requires_grad_(False)
        plan = ff.make_plan(model, ff.layer_policy([nn.Linear]))
    else:
        model = nn.Sequential(nn.ReLU(), nn.Tanh())
        plan = ff.make_plan(model)
        assert plan.units == ()
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, plan, group)
    out = []
    for ours in (
        ff.masked(ff.adamw(), lambda n, s: True),
        ff.masked(ff.scale(2.0), {}),
        ff.multi_transform({"a": ff.sgd(0.1, momentum=0.9)}, lambda n, s: "a"),
        ff.multi_transform({"a": ff.sgd(0.1)}, {}),
    ):
        state = ours.init(params)
        updates, state = ours.update(ff.reduce_grads({}, params), state, params)
        new = ff.update_in_place(ours, ff.reduce_grads({}, params), ours.init(params), ff.tree_map(torch.clone, params))
        out.append((all(t.numel() == 0 for t in updates.values()), new is not None))
    theirs = [
        optax.masked(optax.scale(2.0), {}).update({}, optax.masked(optax.scale(2.0), {}).init({}))[0],
        optax.multi_transform({"a": optax.sgd(0.1)}, {}).update(
            {}, optax.multi_transform({"a": optax.sgd(0.1)}, {}).init({})
        )[0],
    ]
    return out, theirs


@pytest.mark.parametrize("kind", ["frozen", "no-parameters"])
@pytest.mark.parametrize("world", [1, 2])
def test_masked_and_multi_transform_over_no_trainable_parameter_as_optax_test_empty(pool, world, kind):
    for out, theirs in pool.run(_no_trainable, kind, world=world):
        assert theirs == [{}, {}]  # optax: an empty tree in, an empty tree out
        assert out == [(True, True)] * 4


def _skip_large(group):
    """``accumulate(2, sgd, should_skip_update_fn=...)`` against optax's ``MultiSteps`` with
    ``skip_large_updates``: the calls whose gradient is large are skipped, on both sides."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import functools

    import jax
    import optax

    def grads(params, k):
        return _grads_of(params, k, scale=30.0 if k in (1, 4) else 0.3)

    def ours_skip(updates, gradient_step, params):
        norm_squared = float(ff.global_norm(updates)) ** 2
        return norm_squared > 25.0, {"norm_squared": norm_squared}

    ours = ff.accumulate(2, ff.sgd(0.1, momentum=0.9), should_skip_update_fn=ours_skip)
    theirs = optax.MultiSteps(
        optax.sgd(0.1, momentum=0.9),
        2,
        should_skip_update_fn=functools.partial(optax.skip_large_updates, max_squared_norm=25.0),
    )
    theirs = optax.GradientTransformation(theirs.init, jax.jit(theirs.update))
    seen = []

    def change(k, state, jstate):  # records the counters before each step (and, at the end, after)
        if jstate is not None:
            seen.append(((state.mini_step, state.gradient_step), (int(jstate.mini_step), int(jstate.gradient_step))))
        return state, jstate

    shapes = [("w", (3, 4)), ("b", (5,))]
    got, got_ip, want = _ours_and_optax(group, ours, theirs, shapes, steps=7, grads=grads, change=change)
    state = ours.init(ff.shard(ff.functionalize(_Tree(shapes)).params, ff.make_plan(_Tree(shapes)), group))
    return (
        _off(got, want),
        _off(got_ip, want),
        seen,
        state.skip_state,
        ours.outcome(state._replace(last_skipped=True)).value,
    )


@pytest.mark.parametrize("world", [1, 2])
def test_accumulate_takes_should_skip_update_fn_as_optax_multisteps(pool, world):
    # Catches: a skipped call accumulated anyway, or counted as a call of the round.
    for off, off_ip, seen, skip_state, outcome in pool.run(_skip_large, world=world):
        assert off < 2e-6 and off_ip < 2e-6, (off, off_ip)
        assert all(ours == theirs for ours, theirs in seen), seen
        assert [s[0] for s in seen] == [(0, 0), (1, 0), (1, 0), (0, 1), (1, 1), (1, 1), (0, 2)]
        assert skip_state == {"norm_squared": 0.0} and outcome == "rejected"


# --- issue 42: a wrapper's inner norm sees only the parameters it selects ---------------------


def _selected_only_cases(optax):
    matrix = lambda n, s: len(s) >= 2  # noqa: E731
    tree = {"w": True, "b": False}
    label = lambda n, s: "w" if matrix(n, s) else "b"  # noqa: E731
    labels = {"w": "w", "b": "b"}
    nan_b = _nan_at(1, "b", 3)  # a NaN in the parameter the wrapper leaves out
    return {
        "masked_clip": (
            ff.chain(ff.masked(ff.clip_by_global_norm(0.5), matrix), ff.sgd(0.1)),
            optax.chain(optax.masked(optax.clip_by_global_norm(0.5), tree), optax.sgd(0.1)),
            _grads_of,
        ),
        "label_clip": (
            ff.multi_transform({"w": ff.chain(ff.clip_by_global_norm(0.5), ff.sgd(0.1)), "b": ff.sgd(0.1)}, label),
            optax.multi_transform(
                {"w": optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1)), "b": optax.sgd(0.1)}, labels
            ),
            _grads_of,
        ),
        "label_apply_if_finite": (
            ff.multi_transform({"w": ff.apply_if_finite(ff.sgd(0.1), 10), "b": ff.sgd(0.1)}, label),
            optax.multi_transform({"w": optax.apply_if_finite(optax.sgd(0.1), 10), "b": optax.sgd(0.1)}, labels),
            nan_b,
        ),
        "masked_apply_if_finite": (
            ff.chain(ff.masked(ff.apply_if_finite(ff.sgd(0.1), 10), matrix), ff.scale(0.5)),
            optax.chain(optax.masked(optax.apply_if_finite(optax.sgd(0.1), 10), tree), optax.scale(0.5)),
            nan_b,
        ),
    }


def _selected_only(group):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import optax

    shapes = [("w", (6, 5)), ("b", (7,))]  # one unit (the root) holding a selected and an unselected parameter
    out = {}
    for name, (ours, theirs, grads) in _selected_only_cases(optax).items():
        got, got_ip, want = _ours_and_optax(group, ours, theirs, shapes, grads=grads)
        out[name] = (_off(got, want), _off(got_ip, want), bool(want["w"].isfinite().all()))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_masked_and_one_labels_norm_and_finiteness_count_only_their_parameters_as_optax(pool, world):
    # Catches (issue 42.2): clip_by_global_norm and apply_if_finite inside masked / one label of
    # multi_transform norming the whole unit (before: the left-out bias counted in the clip's
    # coefficient, and its NaN made the weight's label reject its own finite update).
    for results in pool.run(_selected_only, world=world):
        assert set(results) == {"masked_clip", "label_clip", "label_apply_if_finite", "masked_apply_if_finite"}
        for name, (off, off_ip, w_finite) in results.items():
            assert w_finite, name
            assert off < 2e-6 and off_ip < 2e-6, (name, off, off_ip)
