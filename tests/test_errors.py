"""Bad input gets a clear error naming the unit, parameter or rank; nothing hangs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsdp_fn as ff
from fsdp_fn.testing import pool_group
from tests.helpers import MLP, make, mse_loss


def _error(fn, *args, **kwargs) -> str:
    """Run ``fn`` and return ``'Type: message'`` of what it raised (inside a rank)."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        notes = "".join(f"\n{n}" for n in getattr(e, "__notes__", []))
        return f"{type(e).__name__}: {e}{notes}"
    raise AssertionError(f"{fn} did not raise")


def _setup(group, kind="mlp"):
    model, policy, loss_fn = make(kind)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, policy)
    return model, fn, plan, ff.shard(fn.params, plan, group), loss_fn


def _plan_differs(group):
    model, policy, _ = make("mlp")
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, policy if group.rank() == 0 else None)
    return _error(ff.shard, fn.params, plan, group)


def test_plan_that_differs_between_ranks(pool):
    for msg in pool.run(_plan_differs, world=3):
        assert msg.startswith("DivergenceError: plans differ between ranks")
        assert "rank 0:" in msg and "ranks 1, 2:" in msg


def _init_differs(group):
    torch.manual_seed(group.rank())  # a forgotten seed
    model = MLP()
    fn = ff.functionalize(model)
    return _error(ff.shard, fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group)


def test_initialisation_that_differs_between_ranks(pool):
    for msg in pool.run(_init_differs, world=2):
        assert "DivergenceError: initial parameters differ between ranks at unit 'net.0'" in msg
        assert "same seed" in msg


def _other_world(group):
    model, fn, plan, params, _ = _setup(group)
    # Shards made for this world size, put in the layout of a group of another size.
    smaller = pool_group(2)
    if smaller is None:
        return None
    wrong = ff.Sharded(params.shards, ff._shard.Layout(plan, smaller))
    x = torch.randn(2, 7)
    return _error(ff.apply_sharded, fn, wrong, fn.buffers, x)


def test_shards_used_with_a_group_of_another_size(pool):
    for msg in pool.run(_other_world, world=3)[:2]:
        assert "ValueError: shard of unit 'net.0' is (35,); world size 2 needs (52,)" in msg
        assert "fsdp_fn: raised in the forward of unit 'net.0'" in msg


def _batch_rejected(group):
    model, fn, plan, params, loss_fn = _setup(group)
    step = ff.train_step(fn, loss_fn, ff.adamw())
    state = step.init(params)
    before = ff.unshard(state.params)
    originals = list(model.parameters())
    msg = _error(step, state, (torch.randn(3, 4), torch.randn(3, 3)))  # 4 features, the model takes 7
    intact = all(torch.equal(before[k], v) for k, v in ff.unshard(state.params).items())
    msg_applied = _error(ff.apply_sharded, fn, state.params, fn.buffers, torch.randn(3, 4))
    # The module keeps its own parameters (the unit's gathered views were put back before them),
    # so the module, value_and_grad and the next step work as if the failure never happened.
    own = all(a is b for a, b in zip(originals, model.parameters(), strict=True))
    good = (torch.randn(3, 7), torch.randn(3, 3))
    model(good[0])
    ff.value_and_grad(fn, loss_fn)(state.params, fn.buffers, good)
    fresh = ff.train_step(fn, loss_fn, ff.adamw())
    expected, _ = fresh(fresh.init(ff.shard(fn.params, plan, group)), good)
    state, _ = step(state, good)
    same = all(torch.equal(a, b) for a, b in zip(ff.tree_leaves(state.params), ff.tree_leaves(expected.params)))
    return msg, msg_applied, intact, own, same


def test_batch_the_model_rejects(pool):
    for msg, msg_applied, intact, own, same in pool.run(_batch_rejected, world=2):
        for m in (msg, msg_applied):
            assert "RuntimeError" in m and "fsdp_fn: raised in the forward of unit 'net.0'" in m
        assert intact and own and same


def _bad_loss(group):
    model, fn, plan, params, _ = _setup(group)
    step = ff.train_step(fn, lambda model, batch: model(batch), ff.adamw())
    return _error(step, step.init(params), torch.randn(2, 7))


def test_loss_that_is_not_a_scalar(pool):
    assert (
        "TypeError: loss_fn must return a floating scalar tensor, got shape (2, 3)" in pool.run(_bad_loss, world=2)[0]
    )


def _params_not_matching(group):
    model, fn, plan, params, _ = _setup(group)
    missing = _error(ff.shard, {k: v for k, v in fn.params.items() if k != "net.2.bias"}, plan, group)
    wrong = dict(fn.params)
    wrong["net.0.weight"] = torch.zeros(2, 2)
    shape = _error(ff.shard, wrong, plan, group)
    return missing, shape


def test_params_that_do_not_match_the_plan(pool):
    missing, shape = pool.run(_params_not_matching, world=1)[0]
    assert "missing ['net.2.bias']" in missing
    assert "parameter 'net.0.weight' is (2, 2) torch.float32; the plan has (13, 7)" in shape


def _used_outside_unit(group):
    class Peek(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(3, 3)
            self.out = nn.Linear(3, 1)

        def forward(self, x):
            return self.out(x @ self.inner.weight)  # reads a unit's weight without calling it

    torch.manual_seed(0)
    m = Peek()
    fn = ff.functionalize(m)
    params = ff.shard(fn.params, ff.make_plan(m, ff.layer_policy([nn.Linear])), group)
    return _error(ff.apply_sharded, fn, params, fn.buffers, torch.randn(2, 3))


def test_parameter_used_outside_its_unit(pool):
    msg = pool.run(_used_outside_unit, world=2)[0]
    assert "parameter 'inner.weight' of unit 'inner' was used outside that unit's forward" in msg


class _Peeks(nn.Module):
    """A root whose own code reads what another unit's parameter is (``self.blocks[0].fc.weight.device``,
    a common idiom) outside that unit's forward, and keeps what it saw."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 5)
        self.body = nn.Sequential(nn.Linear(5, 5), nn.Tanh())
        self.out = nn.Linear(5, 1)
        self.seen: list[tuple] = []

    def forward(self, x):
        w = self.body[0].weight
        self.seen.append((w.device, w.dtype, tuple(w.shape), w.numel(), w.requires_grad, w.is_floating_point()))
        x = x.to(device=w.device, dtype=w.dtype)
        offset = torch.zeros(w.shape[0], device=w.device, dtype=w.dtype)
        return self.out(self.body(self.inp(x) + offset))


def _metadata_of_another_units_parameter(group):
    from fsdp_fn.testing import assert_matches_unsharded

    torch.manual_seed(0)
    model = _Peeks()
    plain = model.body[0].weight
    want = (plain.device, plain.dtype, tuple(plain.shape), plain.numel(), plain.requires_grad, True)
    batches = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(2)]
    policy = ff.layer_policy([nn.Sequential])
    assert_matches_unsharded(model, mse_loss, batches[:1], group=group, policy=policy)  # value_and_grad
    assert_matches_unsharded(
        model, mse_loss, batches, group=group, policy=policy, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)
    )
    fn = ff.functionalize(model)
    ff.apply_sharded(fn, ff.shard(fn.params, ff.make_plan(model, policy), group), fn.buffers, torch.randn(2, 3))
    return set(model.seen), want


def test_reading_what_another_units_parameter_is_works(pool):
    """Before: the stand-in sat on the meta device, so ``x.to(w.device)`` moved the input there and the
    forward raised ``Tensor on device meta is not on the expected device``."""
    for seen, want in pool.run(_metadata_of_another_units_parameter, world=2):
        assert seen == {want}, seen


def _module_read_in_value_and_grad(group):
    model, fn, plan, params, _ = _setup(group)

    def penalised(m, x):  # an L2 penalty written against the module, not through m(...)
        return m(x).square().mean() + sum(p.square().sum() for p in model.parameters())

    grad_fn = ff.value_and_grad(fn, penalised)
    x = torch.randn(2, 7)
    lean = _error(grad_fn, params, fn.buffers, x)
    # shards that require grad: the composable path, for an outer derivative
    composable = _error(
        grad_fn, params.replace({k: v.requires_grad_() for k, v in params.shards.items()}), fn.buffers, x
    )
    return lean, composable


def test_a_loss_reading_the_modules_own_parameters_in_value_and_grad(pool):
    for msg in pool.run(_module_read_in_value_and_grad, world=2)[0]:
        assert "loss_fn read parameter 'net.0.weight' of the module itself (square)" in msg, msg


def _backward_in_loss(group):
    model, fn, plan, params, loss_fn = _setup(group)

    def with_backward(m, batch):  # plain torch's habit, carried into loss_fn
        loss = loss_fn(m, batch)
        loss.backward()
        return loss

    step = ff.train_step(fn, with_backward, ff.adamw())
    state = step.init(params)
    batch = (torch.randn(4, 7), torch.randn(4, 3))
    msg = _error(step, state, batch)
    _error(step, state, batch)
    # The state is still usable, and so is the group: each failed step waited out the
    # exchanges it had in flight (left behind, two steps' worth hung the next step).
    state, metrics = ff.train_step(fn, loss_fn, ff.adamw(), timeout=20.0)(state, batch)
    return msg, bool(torch.isfinite(metrics["loss"]))


def test_a_loss_fn_that_calls_backward_is_told_so(pool):
    for msg, finite in pool.run(_backward_in_loss, world=2):
        assert "Trying to backward through the graph a second time" in msg, msg
        assert "fsdp_fn: did loss_fn call .backward() on its loss?" in msg, msg
        assert finite


def _optimizer_on_unsharded(group):
    model, fn, plan, params, loss_fn = _setup(group)
    opt = ff.from_torch(torch.optim.SGD(model.parameters(), lr=0.1))
    return _error(ff.train_step(fn, loss_fn, opt).init, params)


def test_torch_optimizer_built_on_unsharded_parameters(pool):
    msg = pool.run(_optimizer_on_unsharded, world=2)[0]
    assert "ValueError: the torch optimizer holds 6 tensors, 6 of them not this state's shards" in msg


def _meshes_fsdp_fn_cannot_read(group):
    from torch.distributed.device_mesh import init_device_mesh

    model, policy, _ = make("mlp")
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, policy)
    meshes = {
        "cp": (("dp_replicate", "cp", "fsdp"), (1, 2, 2)),
        "tp without styles": (("dp_replicate", "tp", "fsdp"), (1, 2, 2)),
        "two shard axes": (("fsdp", "dp_shard"), (2, 2)),
        "no shard axis": (("replicate", "ddp"), (2, 2)),
    }
    return {
        k: _error(ff.shard, fn.params, plan, init_device_mesh("cpu", s, mesh_dim_names=n))
        for k, (n, s) in meshes.items()
    }


def test_meshes_without_exactly_one_shard_axis(pool):
    msg = pool.run(_meshes_fsdp_fn_cannot_read, world=4)[0]
    assert "ValueError: the mesh's axis 'cp' names context parallelism, which fsdp_fn does not run yet" in msg["cp"]
    assert "mesh[('dp_replicate', 'fsdp')]" in msg["cp"]
    assert "the mesh's axis 'tp' is tensor-parallel (2 ranks) but the plan splits no module" in msg["tp without styles"]
    assert "make_plan(model, policy, tp=model._tp_plan" in msg["tp without styles"]
    assert "has 2 shard axes ('fsdp', 'dp_shard')" in msg["two shard axes"]
    assert "has 0 shard axes (none)" in msg["no shard axis"]


def _shard_over_a_group_without_this_rank(group):
    """Ranks 0 and 1 form a group (``new_group([0, 1])``, made on every rank as torch requires);
    rank 2 passes it to ``shard`` too. torch hands a rank outside the group ``NON_GROUP_MEMBER``
    (the int -100): before, ``shard`` raised ``TypeError: ... got int``."""
    from fsdp_fn.testing._pool import _groups

    if group.rank() != 2:
        return None
    model, policy, _ = make("mlp")
    fn = ff.functionalize(model)
    return _error(ff.shard, fn.params, ff.make_plan(model, policy), _groups[2])


def test_shard_over_a_group_this_rank_is_not_in(pool):
    msg = pool.run(_shard_over_a_group_without_this_rank, world=3)[2]
    assert msg.startswith(
        "ValueError: this rank (2) is not a member of the process group given: torch.distributed.new_group returns "
        "GroupMember.NON_GROUP_MEMBER on the ranks it leaves out"
    ), msg


def test_process_group_not_initialised():
    m = MLP()
    fn = ff.functionalize(m)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        ff.shard(fn.params, ff.make_plan(m), None)


def test_train_step_arguments():
    m = MLP()
    fn = ff.functionalize(m)
    with pytest.raises(TypeError, match="functionalize"):
        ff.train_step(m, mse_loss, ff.adamw())
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        ff.train_step(fn, 3, ff.adamw())
    with pytest.raises(TypeError, match="optimizer must be an fsdp_fn GradientTransformation"):
        ff.train_step(fn, mse_loss, torch.optim.SGD(m.parameters(), lr=1))


def test_policy_that_claims_no_unit():
    with pytest.raises(ValueError, match=r"layer_policy\(Conv2d\): MLP has no module of these classes"):
        ff.make_plan(MLP(), ff.layer_policy([nn.Conv2d]))
    assert ff.make_plan(MLP(), None).unit_names == ("",)  # one unit on purpose is fine


def _mixed_devices(group):
    model = MLP()
    params = dict(model.named_parameters())
    params["net.0.bias"] = params["net.0.bias"].to("meta")
    return _error(ff.shard, params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group)


def test_parameters_on_mixed_devices(pool):
    assert (
        "ValueError: unit 'net.0' has parameters on several devices: ['cpu', 'meta']"
        in pool.run(_mixed_devices, world=2)[0]
    )


def _shards_from_another_plan(group):
    torch.manual_seed(0)
    a, b = MLP((7, 13, 5, 3)), MLP((7, 11, 5, 3))
    params = ff.shard(dict(a.named_parameters()), ff.make_plan(a, ff.layer_policy([nn.Linear])), group)
    fn_b = ff.functionalize(b)
    return _error(ff.apply_sharded, fn_b, params, fn_b.buffers, torch.randn(2, 7))


def test_shards_from_another_plan(pool):
    msg = pool.run(_shards_from_another_plan, world=2)[0]
    assert "ValueError: these shards were made for another plan: their parameter 'net.0.weight' is (13, 7)" in msg
    assert "but MLP has shape (11, 7)" in msg


def _world_size_changed(group):
    """Shards saved at W=2 and loaded into a run at W=3."""
    torch.manual_seed(0)
    model = MLP()
    plan = ff.make_plan(model, ff.layer_policy([nn.Linear]))
    two = pool_group(2)
    saved = ff.shard(dict(model.named_parameters()), plan, two).shards if two is not None else None
    if saved is None:
        saved = {u.name: torch.zeros(u.shard_numel(2)) for u in plan.units}
    now = ff.Sharded(saved, ff._shard.Layout(plan, group))
    fn = ff.functionalize(model)
    step = ff.train_step(fn, mse_loss, ff.sgd())
    x = (torch.randn(2, 7), torch.randn(2, 3))
    return _error(step, step.init(now), x)


def test_world_size_that_changed(pool):
    for msg in pool.run(_world_size_changed, world=3):
        assert "shard of unit 'net.0' is (52,); world size 3 needs (35,)" in msg


def _meta_model_to_shard(group):
    with torch.device("meta"):
        model = MLP()
    fn = ff.functionalize(model)
    return _error(ff.shard, fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group)


def test_meta_model_given_to_shard(pool):
    msg = pool.run(_meta_model_to_shard, world=2)[0]
    assert "ValueError: parameter 'net.0.weight' is on the meta device and holds no values" in msg
    assert "init_shards" in msg


def _state_of_another_optimizer(group):
    _, fn, plan, params, loss_fn = _setup(group)
    adamw_state = ff.train_step(fn, loss_fn, ff.adamw()).init(params)
    sgd_step = ff.train_step(fn, loss_fn, ff.sgd(lr=0.1, momentum=0.9))
    batch = (torch.randn(4, 7), torch.randn(4, 3))
    message = _error(sgd_step, adamw_state, batch)
    _, metrics = sgd_step(sgd_step.init(params), batch)  # its own state trains
    return message, bool(torch.isfinite(metrics["loss"]))


def test_the_state_of_another_optimizer_is_named(pool):
    # Catches: AdamW's state handed to an SGD step failing deep in the update with a raw
    # AttributeError (before), or a check that refuses the step's own state.
    for message, trains in pool.run(_state_of_another_optimizer, world=2):
        assert message.startswith("TypeError: the optimizer state given to this step is not sgd's"), message
        assert "ScaleByAdamState" in message and "TraceState" in message, message
        assert "step.init(params)" in message
        assert trains


def _optimizer_on_some_shards(group):
    _, fn, plan, params, loss_fn = _setup(group)
    some = list(params.values())[:1]
    return _error(ff.train_step(fn, loss_fn, ff.from_torch(torch.optim.SGD(some, lr=0.1))).init, params)


def test_torch_optimizer_built_on_some_shards_only(pool):
    # Catches: the message blaming foreign tensors when shards are missing (issue 34): the units
    # left out would never be stepped.
    for msg in pool.run(_optimizer_on_some_shards, world=2):
        assert msg.startswith("ValueError: the torch optimizer holds 1 of this state's 3 shards"), msg
        assert "misses those of units 'net.2', 'net.4'" in msg, msg
        assert "not this state's shards" not in msg, msg
