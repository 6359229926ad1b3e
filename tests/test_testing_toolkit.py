"""fsdp_fn.testing: the strategies draw what they promise, and assert_matches_unsharded finds divergences."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdp_fn as ff
from fsdp_fn import testing as fft


def _mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _sgd(tensors):
    return torch.optim.SGD(tensors, lr=0.1, momentum=0.9)


def _match(group, spec, plan_spec, train, steps=2):
    model = spec.build()
    batches = [spec.batch(12, seed=s) for s in range(steps)]
    return fft.assert_matches_unsharded(
        model,
        _mse,
        batches,
        group=group,
        plan=plan_spec.make(model),
        optimizer=_sgd if train else None,
        rtol=1e-9,
        atol=1e-10,
    )


@settings(max_examples=12)
@given(spec=fft.models(), plan=fft.plans(), world=fft.worlds(), train=st.booleans())
def test_drawn_models_match_their_unsharded_selves(pool, spec, plan, world, train):
    worst = pool.run(_match, spec, plan, train, world=world)
    assert worst[0] == worst[-1]  # every rank compared the same (replicated) values
    assert worst[0]["gradient"] < 1e-10 and worst[0]["parameter"] < 1e-10
    assert worst[0]["loss"] < 1e-6  # the train step reports its loss in float32


def _hybrid(group, spec):
    layout = fft.LayoutSpec(4, 2)
    model = spec.build()
    batches = [spec.batch(8, seed=s) for s in range(2)]
    return fft.assert_matches_unsharded(
        model, _mse, batches, group=layout.group(), optimizer=_sgd, rtol=1e-9, atol=1e-10
    )


def test_hybrid_layout_matches(pool):
    worst = pool.run(_hybrid, fft.ModelSpec((5, 7, 1), seed=3), world=4)
    assert worst[0]["gradient"] < 1e-10 and worst[0]["parameter"] < 1e-10
    assert worst[0]["loss"] < 1e-6  # the train step reports its loss in float32


class _Nudged:
    """A loss that differs from the reference's in one parameter's gradient only (its value is the same)."""

    def __init__(self, param: str, from_call: int) -> None:
        self.param, self.from_call, self.calls = param, from_call, 0

    def __call__(self, model, batch):
        loss = _mse(model, batch)
        if isinstance(model, nn.Module):  # the unsharded reference
            self.calls += 1
            if self.calls > self.from_call:
                w = model.get_parameter(self.param)
                loss = loss + 0.5 * (w - w.detach()).sum()
        return loss


def _diverge(group, train):
    spec = fft.ModelSpec((5, 7, 3, 1), seed=1)
    model = spec.build()
    batches = [spec.batch(6, seed=s) for s in range(3)]
    try:
        fft.assert_matches_unsharded(
            model,
            _Nudged("layers.1.weight", from_call=1),
            batches,
            group=group,
            plan=fft.PlanSpec().make(model),
            optimizer=_sgd if train else None,
        )
    except fft.Divergence as e:
        return e.where, str(e)
    return None


@pytest.mark.parametrize("train", [False, True])
def test_divergence_names_step_unit_and_parameter(pool, train):
    where, message = pool.run(_diverge, train, world=3)[0]
    kind = "parameter" if train else "gradient"
    assert where["step"] == 1 and where["what"] == kind
    assert where["parameter"] == "layers.1.weight"
    assert where["error"] > 1e-3
    assert message.startswith(f"step 1: the {kind} of unit")
    assert "parameter 'layers.1.weight'" in message


@settings(max_examples=30)
@given(spec=fft.models(max_world=4))
def test_model_strategy(spec):
    assert all(w % k for w in spec.widths for k in (2, 3, 4))
    model = spec.build()
    if spec.tied:
        assert model.layers[0].weight is model.layers[-1].weight
    frozen = {i for i, layer in enumerate(model.layers) if not layer.weight.requires_grad}
    assert frozen == set(spec.frozen)
    assert any(p.requires_grad for p in model.parameters())


def test_step_options_without_an_optimizer_are_refused():
    model = fft.ModelSpec((3, 1)).build()
    with pytest.raises(ValueError, match=r"train_step options \['remat'\] need an optimizer"):
        fft.assert_matches_unsharded(model, _mse, [], remat=True)


# --- issue 42.12: a GradientTransformation, and a step of the user's own ---------------------


def _local_norm(grads):
    """This rank's shards' 2-norm only: what a transformation written without the global norm takes."""
    return float(sum(t.double().square().sum() for t in grads.values()) ** 0.5)


def _locally_clipped(max_norm):
    """A transformation of one's own that clips by this rank's norm: right at W=1, wrong when sharded."""

    def update(grads, state, params=None):
        coef = min(1.0, max_norm / (_local_norm(grads) + 1e-6))
        return ff.tree_map(lambda t: t * coef, grads), state

    return ff.GradientTransformation(lambda params: ff.EmptyState(), update, "locally_clipped")


def _extragradient(local):
    """A step of one's own: two gradients a step (the second at a look-ahead point), a decaying
    rate in its state; ``local``: the second gradient divided by this rank's norm (a bug)."""

    def step(fn, loss_fn, params, state, batch):
        count = 0 if state is None else state
        vg = ff.value_and_grad(fn, loss_fn)
        loss, g = vg(params, fn.buffers, batch)
        ahead = ff.apply_updates(params, ff.tree_map(lambda t: -0.05 * t, g))
        _, g2 = vg(ahead, fn.buffers, batch)
        lr = 0.1 / (count + 1) / (_local_norm(g2) if local else 1.0)
        return loss, ff.apply_updates(params, ff.tree_map(lambda t: -lr * t, g2)), count + 1

    return step


def _own(group, kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))  # uneven shards at W=2, 3
    policy = ff.layer_policy([nn.Linear])
    batches = [(torch.randn(12, 5, generator=torch.Generator().manual_seed(s)), torch.randn(12, 3)) for s in range(3)]
    kw = {
        "transformation": {"optimizer": ff.chain(ff.clip_by_global_norm(0.05), ff.adamw(lr=1e-2))},
        "local_transformation": {"optimizer": ff.chain(_locally_clipped(0.05), ff.sgd(lr=0.1))},
        "step": {"step": _extragradient(local=False)},
        "local_step": {"step": _extragradient(local=True)},
    }[kind]
    try:
        return fft.assert_matches_unsharded(
            model, _mse, batches, group=group, policy=policy, rtol=1e-5, atol=1e-6, **kw
        )
    except fft.Divergence as e:
        return e.where


@pytest.mark.parametrize("world", [1, 2, 3])
def test_assert_matches_unsharded_takes_a_gradient_transformation(pool, world):
    # Catches (issue 42.12): only torch.optim factories taken (before: a GradientTransformation was
    # called as a factory), and a reference that does not run the transformation: one that norms
    # this rank's shards only matches at W=1 and is caught sharded.
    for worst in pool.run(_own, "transformation", world=world):
        assert "what" not in worst, worst  # no Divergence
        assert worst["parameter"] < 1e-6 and worst["gradient"] == 0.0, worst
    for where in pool.run(_own, "local_transformation", world=world):
        if world == 1:
            assert "what" not in where, where
        else:
            assert where["what"] == "parameter" and where["step"] == 0, where


@pytest.mark.parametrize("world", [1, 2, 3])
def test_assert_matches_unsharded_takes_a_step_of_ones_own(pool, world):
    # Catches: no way to check a custom step (two gradients a step, state of its own) against
    # itself on one process; a step that reads this rank's shards only is caught sharded.
    for worst in pool.run(_own, "step", world=world):
        assert "what" not in worst, worst  # no Divergence
        assert worst["parameter"] < 1e-6 and worst["loss"] < 1e-6, worst
        assert worst["gradient"] == 0.0  # it trained by the step: no gradient was compared
    for where in pool.run(_own, "local_step", world=world):
        if world == 1:
            assert "what" not in where, where
        else:
            assert where["what"] == "parameter" and where["step"] == 0, where


def test_assert_matches_unsharded_takes_an_optimizer_or_a_step_not_both():
    with pytest.raises(ValueError, match="takes an optimizer or a step of your own, not both"):
        fft.assert_matches_unsharded(nn.Linear(2, 1), _mse, [], optimizer=_sgd, step=_extragradient(False))
