"""ZeRO-3 memory semantics, measured with the meter: shards only, one unit in flight."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig
from tests.helpers import batch_for, gpt_state, local_part, make, refills_on_demand

CFG = GPTConfig(vocab=64, seq=16, d_model=32, n_layers=6, n_heads=2)


def _measured_step(group, split_root=False, update_in_backward=False, reshard_after_forward=True, prefetch=True):
    world, rank = group.size(), group.rank()
    plan, step, state = gpt_state(
        group,
        CFG,
        split_root=split_root,
        update_in_backward=update_in_backward,
        reshard_after_forward=reshard_after_forward,
        forward_prefetch=prefetch,
        backward_prefetch=ff.BackwardPrefetch.BACKWARD_PRE if prefetch else None,
    )
    batch = local_part(
        torch.randint(0, CFG.vocab, (4 * world, CFG.seq + 1), generator=torch.Generator().manual_seed(0)), rank, world
    )
    state, _ = step(state, batch)  # warm: nothing is created lazily in the measured step
    with ff.MemoryMeter() as meter, ff.comm_log() as log:
        meter.tag(state, "state")
        state, _ = step(state, batch)
        meter.sample("after the step")
    estimate = ff.estimate_memory(
        plan, world, update_in_backward=update_in_backward, units_in_flight=2 if prefetch else 1
    )
    return {
        "peaks": meter.category_peaks(),
        "after": dict(meter.current),
        "estimate": estimate,
        "plan": plan,
        "all_gathers": sum(c.unit is not None for c in log.of("all_gather")),  # units, not the metrics
        "shard_bytes": sum(t.numel() * t.element_size() for t in state.params.values()),
    }


@pytest.mark.parametrize(("world", "prefetch"), [(2, False), (3, False), (2, True), (3, True)])
def test_units_in_flight_and_only_shards_after_a_step(pool, world, prefetch):
    out = pool.run(_measured_step, world=world, prefetch=prefetch)[0]
    plan, peaks, est = out["plan"], out["peaks"], out["estimate"]
    root = plan.unit("").gather_bytes(world)
    block = max(u.gather_bytes(world) for u in plan.units if u.name)
    assert len(plan.units) == 7  # root + 6 blocks
    # Gathered parameters never exceed the root plus the blocks the schedule allows in
    # flight: one without prefetching, two with it.
    in_flight = 2 if prefetch else 1
    assert peaks["gathered"] <= root + in_flight * block
    assert peaks["gathered"] > root + (in_flight - 1) * block  # and that many really were gathered
    assert peaks["gathered"] <= est.gathered
    # Steady state: parameter bytes per rank are total / W plus padding, exactly.
    assert out["after"]["params"] == out["shard_bytes"] == est.params
    assert est.params == sum(u.shard_numel(world) for u in plan.units) * 4
    assert est.params * world - plan.numel * 4 < 4 * world * len(plan.units)  # padding < W elements per unit
    assert out["after"]["optimizer"] == est.optimizer
    # After the step no full-size gradient and no gathered parameter is alive.
    assert out["after"]["gathered"] == 0
    assert out["after"]["grads"] == 0


def test_update_in_backward_keeps_gradient_shards_to_one_unit(pool):
    plain = pool.run(_measured_step, world=2)[0]
    lean = pool.run(_measured_step, world=2, update_in_backward=True)[0]
    full_grad = max(u.gather_bytes(2) for u in lean["plan"].units)
    # Without it, every unit's gradient shard lives until the optimizer runs.
    assert plain["peaks"]["grads"] >= plain["estimate"].params
    # With it: the unit being reduced (its reduction ends before the next unit's flat
    # gradient exists: one full unit gradient at a time) and one gradient shard.
    assert lean["estimate"].full_grad == full_grad
    assert lean["peaks"]["grads"] <= lean["estimate"].full_grad + lean["estimate"].grads
    assert lean["peaks"]["grads"] < plain["peaks"]["grads"]


def _issued_before_the_norm(group):
    from examples.gpt import lm_loss

    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = GPT(CFG)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]), split_root=True)
    step = ff.train_step(fn, lm_loss, ff.adamw())
    state = step.init(ff.shard(fn.params, plan, group))
    tokens = torch.randint(0, CFG.vocab, (2 * world, CFG.seq + 1), generator=torch.Generator().manual_seed(0))
    state, _ = step(state, local_part(tokens, rank, world))  # the previous step's order guides the prefetch
    seen: list[list[str | None]] = []
    with ff.comm_log() as log, ff.MemoryMeter() as meter:
        meter.tag(state, "state")
        # Registered before the step's own hooks, so it runs before the final norm is gathered.
        hook = model.ln_f.register_forward_pre_hook(lambda m, a: seen.append([c.unit for c in log.of("all_gather")]))
        try:
            step(state, local_part(tokens, rank, world))
        finally:
            hook.remove()
    largest = max(u.gather_bytes(world) for u in plan.units)
    return seen[0], meter.category_peaks()["gathered"], largest


def test_forward_prefetch_looks_past_a_small_unit(pool):
    # The final norm is tiny: while the last block runs, the head after it is gathered too,
    # so its gather hides behind the block rather than behind the norm alone. Catches a
    # prefetch that counts units instead of bytes (two units in flight: block and norm).
    before_norm, gathered_peak, largest = pool.run(_issued_before_the_norm, world=2)[0]
    last = f"blocks.{CFG.n_layers - 1}"
    assert before_norm[-3:] == [last, "ln_f", "head"]
    assert gathered_peak <= 2 * largest  # still within max_inflight (2) times the largest unit


def test_split_root_lowers_gathered_peak(pool):
    whole = pool.run(_measured_step, world=2, prefetch=False)[0]
    split = pool.run(_measured_step, world=2, split_root=True, prefetch=False)[0]
    assert "" not in split["plan"].unit_names
    largest = max(u.gather_bytes(2) for u in split["plan"].units)
    assert split["peaks"]["gathered"] <= largest
    assert split["peaks"]["gathered"] < whole["peaks"]["gathered"]


def test_keep_gathered_trades_memory_for_one_all_gather_per_unit(pool):
    resharded = pool.run(_measured_step, world=2, prefetch=False)[0]
    kept = pool.run(_measured_step, world=2, reshard_after_forward=False, prefetch=False)[0]
    blocks = sum(1 for u in kept["plan"].units if u.name)
    # Every block but the last is gathered again for backward (the last one, needed again
    # first, is kept from the second step on), so keeping them saves blocks - 1 gathers.
    assert kept["all_gathers"] == len(kept["plan"].units)
    assert resharded["all_gathers"] - kept["all_gathers"] == blocks - 1
    assert kept["peaks"]["gathered"] > resharded["peaks"]["gathered"]


# --- meta-device initialisation ------------------------------------------------------------------


def _meta_init(group, seed=3, frozen=()):
    with torch.device("meta"):
        model = GPT(CFG)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(frozen))
    plan = ff.make_plan(model, ff.layer_policy([Block]))
    with ff.MemoryMeter() as meter:
        params, buffers = ff.init_shards(model, plan, group, seed=seed)
    full = ff.unshard(params)
    on_meta = all(p.is_meta for p in model.parameters())
    return {
        "full": full if group.rank() == 0 else None,
        "peak": meter.peak()["total"],
        "largest_unit": max(u.gather_bytes() for u in plan.units),
        "shards": sum(t.numel() * t.element_size() for t in params.values()),
        "model": plan.numel * 4,
        "on_meta": on_meta,
    }


def test_meta_init_is_the_same_model_at_every_world_size(pool):
    runs = {w: pool.run(_meta_init, world=w) for w in (1, 2, 3)}
    ref = runs[1][0]["full"]
    for w in (2, 3):
        full = runs[w][0]["full"]
        assert full.keys() == ref.keys()
        for k in ref:
            assert torch.equal(full[k], ref[k]), k
    assert ref["blocks.0.qkv.weight"].std() > 0.01  # really initialised (GPT.reset_parameters)
    assert torch.equal(ref["blocks.0.ln1.weight"], torch.ones(CFG.d_model))


def test_meta_init_with_frozen_parameters_is_the_same_model(pool):
    """Frozen parameters (a fine-tuning run's, or a template for ``checkpoint.load``) are
    initialised like the rest; freezing changes no value (before: ``KeyError``)."""
    ref = pool.run(_meta_init, world=1)[0]["full"]
    for w in (1, 2, 3):
        full = pool.run(_meta_init, 3, ("wte", "blocks.1.qkv", "blocks.0.ln1.bias"), world=w)[0]["full"]
        assert full.keys() == ref.keys()
        for k in ref:
            assert torch.equal(full[k], ref[k]), (w, k)


def test_meta_init_never_holds_the_full_model(pool):
    for r in pool.run(_meta_init, world=3):
        assert r["on_meta"]  # the user's module is left on meta
        assert r["peak"] <= r["shards"] + r["largest_unit"]
        assert r["peak"] < r["model"] / 2


def _meta_without_initialiser(group):
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3, 3))

        def forward(self, x):
            return x @ self.w

    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(3, 3), Bare())
    plan = ff.make_plan(m)
    try:
        ff.init_shards(m, plan, group)
    except ValueError as e:
        message = str(e)
    params, _ = ff.init_shards(
        m, plan, group, init=lambda mod: [nn.init.ones_(p) for p in mod.parameters(recurse=False)]
    )
    return message, ff.unshard(params)["1.w"].sum().item()


def test_meta_model_without_initialiser(pool):
    message, total = pool.run(_meta_without_initialiser, world=2)[0]
    assert "module '1' (Bare) is on the meta device" in message
    assert "pass init=fn" in message
    assert total == 9.0


def test_estimate_from_the_plan_alone():
    with torch.device("meta"):
        model = GPT(CFG)
    plan = ff.make_plan(model, ff.layer_policy([Block]))
    est = ff.estimate_memory(plan, 4)
    assert est.params == sum(u.shard_numel(4) for u in plan.units) * 4
    assert est.optimizer == 2 * est.params + 4 * sum(len(u.params) for u in plan.units)
    assert est.gathered == plan.unit("").gather_bytes(4) + plan.unit("blocks.0").gather_bytes(4)
    lean = ff.estimate_memory(plan, 4, update_in_backward=True, optimizer_slots=1)
    assert lean.grads == max(u.shard_numel(4) for u in plan.units) * 4
    assert lean.optimizer == est.params + 4 * sum(len(u.params) for u in plan.units)


def _integer_estimate(group):
    """A bf16 step of a model with integer parameters, measured, beside its estimate."""
    world, rank = group.size(), group.rank()
    model, policy, loss_fn = make("int")
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, policy)
    schedule = ff.Schedule(mixed_precision=ff.MixedPrecision(param_dtype=torch.bfloat16))
    step = ff.train_step(fn, loss_fn, ff.adamw(), schedule=schedule)
    state = step.init(ff.shard(fn.params, plan, group))
    batch = local_part(batch_for("int", model, 0), rank, world)
    state, _ = step(state, batch)
    with ff.MemoryMeter() as meter:
        meter.tag(state, "state")
        state, _ = step(state, batch)
    held = [*state.params.values(), *(t for part in state.params.layout.frozen.values() for t in part)]
    return plan, ff.estimate_memory(plan, world, schedule=schedule), meter.category_peaks(), held


def test_estimate_counts_integer_parameters_in_their_own_dtype(pool):
    # Catches: frozen (integer) shards left out of the parameters' bytes, an integer part counted
    # in the bf16 gather dtype or as a gradient, optimizer state for it.
    plan, est, peaks, held = pool.run(_integer_estimate, world=3)[0]
    assert est.params == sum(t.numel() * t.element_size() for t in held)  # every shard this rank holds
    trainable = sum(u.shard_numel(3) * 4 for u in plan.units)
    assert est.optimizer == 2 * trainable + 4 * sum(len(u.params) for u in plan.units)
    assert est.full_grad == max(u.padded_numel(3) for u in plan.units) * 4  # no frozen part has a gradient
    block = plan.unit("blocks.0")
    assert block.gather_bytes(3, torch.bfloat16) == 30 * 2 + 6 * 8 + 6 * 2  # int64 in 8 bytes, floats in 2
    assert est.gathered == plan.unit("").gather_bytes(3, torch.bfloat16) + 2 * block.gather_bytes(3, torch.bfloat16)
    assert 0 < peaks["gathered"] <= est.gathered


class _Probe(nn.Linear):
    """A Linear that records where its weight's storage is while it runs."""

    seen: ClassVar[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.weight
        while torch._C._functorch.is_functorch_wrapped_tensor(t):  # under torch.func.vjp
            t = torch._C._functorch.get_unwrapped(t)
        _Probe.seen.append(t.untyped_storage().data_ptr())
        return super().forward(x)


def _one_rank_uses_shards_in_place(group):
    torch.manual_seed(0)
    model = nn.Sequential(_Probe(5, 7), nn.Tanh(), _Probe(7, 2))
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([_Probe])), group)
    step = ff.train_step(fn, lambda m, b: m(b).square().mean(), ff.sgd(lr=0.1))
    state = step.init(params)
    where = [state.params[u].untyped_storage().data_ptr() for u in params.plan.unit_names if u]
    _Probe.seen.clear()
    step(state, torch.randn(3, 5))
    return _Probe.seen == where


def test_one_rank_uses_its_shards_in_place(pool):
    # Catches: a unit gathered into a copy on one rank, where the shard already is the whole unit.
    assert pool.run(_one_rank_uses_shards_in_place, world=1)[0]


def _forward_gathered_peak(group, forward_prefetch):
    """The most gathered bytes during the forward alone (read from inside the loss)."""
    from examples.gpt import lm_loss

    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = GPT(CFG)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]), split_root=False)
    seen, box = {}, {}

    def loss_fn(m, batch):
        loss = lm_loss(m, batch)
        if "meter" in box:  # the forward is done: no backward yet
            seen["forward"] = box["meter"].category_peaks()["gathered"]
        return loss

    step = ff.train_step(
        fn, loss_fn, ff.adamw(), schedule=ff.Schedule(forward_prefetch=forward_prefetch, backward_prefetch=None)
    )
    state = step.init(ff.shard(fn.params, plan, group))
    tokens = torch.randint(0, CFG.vocab, (2 * world, CFG.seq + 1), generator=torch.Generator().manual_seed(0))
    state, _ = step(state, local_part(tokens, rank, world))  # the previous step's order guides the prefetch
    with ff.MemoryMeter() as meter:
        box["meter"] = meter
        meter.tag(state, "state")
        step(state, local_part(tokens, rank, world))
    root = plan.unit("").gather_bytes(world)
    block = max(u.gather_bytes(world) for u in plan.units if u.name)
    return seen["forward"], root, block


def test_forward_prefetch_gathers_the_next_unit_while_one_runs(pool):
    # a prefetch that never starts (a negated in-flight check) keeps one block at a time
    on = pool.run(_forward_gathered_peak, True, world=2)[0]
    off = pool.run(_forward_gathered_peak, False, world=2)[0]
    peak_on, root, block = on
    assert peak_on == root + 2 * block  # the running block and the next one
    assert off[0] == root + block  # without forward prefetch: one block at a time


# --- a unit's gradient lives once -----------------------------------------------------------------


class _Stack(nn.Sequential):
    """A unit of its own (the root's gradients are held until its backward ends: they come spread out)."""


def _grad_buffers_allocated(group):
    """How many full-gradient buffers of a block's size one train step allocates."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fsdp_fn._labels import current

    world, rank = group.size(), group.rank()
    plan, step, state = gpt_state(group, CFG, split_root=True)
    block = plan.unit("blocks.0").padded_numel(world)
    tokens = torch.randint(0, CFG.vocab, (2 * world, CFG.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = local_part(tokens, rank, world)
    state, _ = step(state, batch)
    allocated = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.empty.memory_format and current() == "grads" and out.numel() == block:
                allocated.append(out.numel())
            return out

    with Count():
        step(state, batch)
    return len(allocated), CFG.n_layers


def test_blocks_write_their_gradients_into_one_buffer(pool):
    # A block's full gradient is free once its reduce-scatter ends, just before the next
    # block's is needed: the next one is written into it, so a step allocates (and the
    # CPU faults in) one block-sized gradient buffer, not one per block.
    allocated, blocks = pool.run(_grad_buffers_allocated, world=2)[0]
    assert blocks > 2
    assert allocated == 1


def _copied_from_shard(group):
    """Elements one train step copies out of block 0's shard, and what the pieces of its
    parameters that cross this rank's slot edges add up to (copied once per gather: forward
    and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    world, rank = group.size(), group.rank()
    plan, step, state = gpt_state(group, CFG, split_root=True)
    unit = plan.unit("blocks.0")
    tokens = torch.randint(0, CFG.vocab, (2 * world, CFG.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = local_part(tokens, rank, world)
    state, _ = step(state, batch)
    shard = state.params["blocks.0"].untyped_storage().data_ptr()
    copied = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default and args[1].untyped_storage().data_ptr() == shard:
                copied.append(args[1].numel())
            return func(*args, **(kwargs or {}))

    with Count():
        step(state, batch)
    crossing = sum(hi - lo for i, lo, hi in unit.local_ranges(world, rank) if 0 < hi - lo < unit.params[i].numel)
    return sum(copied), 2 * crossing, unit.shard_numel(world)


def test_a_gather_copies_only_the_parameters_crossing_the_slot_edges(pool):
    # A parameter wholly in this rank's shard is a view of the shard: the gather does not
    # copy the shard into the rank's own slot of the buffer, only the pieces of the (at most
    # two) parameters that cross the slot's edges. Catches the whole shard copied per gather.
    for world in (2, 3):
        for copied, crossing, shard in pool.run(_copied_from_shard, world=world):
            assert copied == crossing < shard, (world, copied, crossing, shard)


def _backward_extra(group, width=64, layers=4):
    """Peak bytes of one lean value_and_grad on a unit made of bias-free Linears (batch 1:
    activations are a few hundred bytes), beyond the shards and the gathered unit."""
    torch.manual_seed(0)
    model = nn.Sequential(_Stack(*(nn.Linear(width, width, bias=False) for _ in range(layers))))
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([_Stack])), group)
    grad_fn = ff.value_and_grad(fn, lambda m, x: m(x).square().sum())
    x = torch.randn(1, width)
    grad_fn(params, fn.buffers, x)  # warm
    with ff.MemoryMeter() as meter:
        meter.tag(params, "params")
        _, grads = grad_fn(params, fn.buffers, x)
    peak = meter.peak()
    unit = params.plan.unit("0")
    assert params.plan.unit_names == ("0",), params.plan.unit_names
    return peak["total"] - peak["params"] - peak["gathered"], unit.gather_bytes(group.size()), width * width * 4


def test_a_units_gradient_lives_once(pool):
    # Catches: per-parameter gradients kept until the unit's backward ends and then
    # concatenated into the flat buffer its reduce-scatter sends (the gradient twice).
    for extra, full, largest in pool.run(_backward_extra, world=2):
        # The flat gradient, plus the larger of one parameter's gradient (being written into
        # it) and the reduce-scatter's received half; a few KiB for activations.
        assert extra <= full + max(largest, full // 2) + 4096, (extra, full)


def _grads_peak_in_backward(group):
    out = _measured_step(group, update_in_backward=True)
    plan, world = out["plan"], group.size()
    full = max(u.gather_bytes(world) for u in plan.units)
    shard = max(u.shard_numel(world) for u in plan.units) * 4
    return out["peaks"]["grads"], full, shard


def test_one_full_unit_gradient_at_a_time(pool):
    # Catches: the reduction left in flight behind the next unit's backward still holding the
    # previous unit's full gradient when the next one's is allocated (two at once).
    for grads, full, shard in pool.run(_grads_peak_in_backward, world=2):
        assert grads <= full + shard, (grads, full, shard)


class _Shift(nn.Module):
    """One parameter added to an input of its own shape: autograd hands the same gradient
    tensor to the input's path and to the parameter (the unit may take it as its flat gradient)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.p


class _SumOfBranches(nn.Module):
    """``shift(shift(x) + side(x))``: the sum hands one gradient tensor to both of its inputs,
    and the side branch, made before the first shift ran, runs its backward after it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.side, self.shift = nn.Linear(8, 8), nn.Linear(8, 8), _Shift(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.first(x))
        side = self.side(x)
        return torch.tanh(self.shift(self.shift(x) + side))


def _shared_gradient_grads(group, accumulate, kind):
    torch.manual_seed(0)
    if kind == "chain":
        shift = _Shift(8)
        model = nn.Sequential(nn.Linear(8, 8), shift, nn.Tanh(), nn.Linear(8, 8), shift, nn.Tanh())  # used twice
    else:
        model = _SumOfBranches()
    x = torch.randn(8)  # unbatched: x + p has p's shape, so no reduction makes a fresh gradient
    loss_fn = lambda m, b: m(b).square().sum()  # noqa: E731
    reference = torch.autograd.grad(loss_fn(model, x), list(model.parameters()))
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([_Shift]))
    if accumulate is None:
        _, grads = ff.value_and_grad(fn, loss_fn)(ff.shard(fn.params, plan, group), fn.buffers, x)
        got = ff.unshard(grads)
    else:  # SGD with lr 1 from zero-initialised copies: the step moves each parameter by -grad
        schedule = ff.Schedule(micro_batches=2, reduce_each_micro_batch=accumulate == "each")
        step = ff.train_step(fn, loss_fn, ff.sgd(lr=1.0), schedule=schedule)
        state = step.init(ff.shard(fn.params, plan, group))
        before = ff.unshard(state.params)
        state, _ = step(state, [x, x])
        got = {k: before[k] - v for k, v in ff.unshard(state.params).items()}
    names = [n for n, _ in model.named_parameters()]
    return max((got[n] - r).abs().max().item() for n, r in zip(names, reference, strict=True))


@pytest.mark.parametrize("kind", ["chain", "branches"])
@pytest.mark.parametrize("accumulate", [None, "each", "once"])
def test_a_gradient_shared_with_another_path_stays_exact(pool, accumulate, kind):
    # Catches: a one-parameter unit taking autograd's gradient tensor as its flat gradient and
    # then writing into it while the input's path (or a second use) still reads it; with
    # "once" and two branches, the second use's gradient summed into the first one's while
    # the side branch still has to read it.
    for diff in pool.run(_shared_gradient_grads, accumulate, kind, world=2):
        assert diff < 1e-6


# --- backward prefetch: the next unit is refilled once the last reduction has landed -----------


def _backward_overlaps(group, kind):
    """During one train step: the samples where a reduction's buffers (its received shards) live
    together with two blocks gathered, and the uses whose refill backward had to start itself."""
    from examples.gpt import lm_loss

    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = GPT(CFG)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]), split_root=True)
    schedule = ff.Schedule(update_in_backward=kind == "update_in_backward")
    remat = ff.Remat() if kind == "remat" else None
    step = ff.train_step(fn, lm_loss, ff.adamw(), schedule=schedule, remat=remat)
    state = step.init(ff.shard(fn.params, plan, group))
    tokens = torch.randint(0, CFG.vocab, (2 * world, CFG.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = local_part(tokens, rank, world)
    state, _ = step(state, batch)
    with refills_on_demand() as on_demand, ff.MemoryMeter(timeline=True) as meter:
        meter.tag(state, "state")
        step(state, batch)
    assert meter.timeline is not None
    block = plan.unit("blocks.0").gather_bytes(world)
    together = [what for what, s in meter.timeline if s["comm"] > 0 and s["gathered"] >= 2 * block]
    return together, on_demand, max(s["comm"] for _, s in meter.timeline)


@pytest.mark.parametrize("kind", ["defaults", "update_in_backward", "remat"])
def test_backward_refills_the_next_unit_once_the_last_reduction_has_landed(pool, kind):
    # Catches: the next block refilled when this one's backward starts, while the previous
    # block's reduce-scatter still holds its received shards (at W=4, three of them): the
    # three at once at the top of the backward, where memory peaks; and a unit kept gathered
    # after forward (the head) starting no refill, so the one before it waits on its own.
    for together, on_demand, comm in pool.run(_backward_overlaps, kind, world=3):
        assert comm > 0  # the reductions' received shards were seen
        assert together == [], together[:3]
        assert on_demand == [], on_demand  # every refill was prefetched


class _RoutedBlock(nn.Module):
    """A block that also returns an auxiliary output made from its own parameters (as a
    mixture-of-experts block returns its router's logits for a balancing loss)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.router = nn.Linear(d, d), nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + torch.tanh(self.fc(x)), self.router(x)


class _Routed(nn.Module):
    def __init__(self, d: int = 64, blocks: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_RoutedBlock(d) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logits = []
        for block in self.blocks:
            x, routed = block(x)
            logits.append(routed)
        return x, logits


def _routed_loss(model, batch):
    out, logits = model(batch)
    # The auxiliary term's gradient reaches every block's router first thing in backward.
    return out.square().mean() + 0.01 * sum(z.logsumexp(-1).square().mean() for z in logits)


def _gathered_with_early_gradients(group):
    world = group.size()
    torch.manual_seed(0)
    model = _Routed()
    x = torch.randn(8, 64)
    reference = torch.autograd.grad(_routed_loss(model, x), list(model.parameters()))
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([_RoutedBlock]))
    step = ff.train_step(fn, _routed_loss, ff.sgd(lr=1.0))
    state = step.init(ff.shard(fn.params, plan, group))
    before = ff.unshard(state.params)
    with ff.MemoryMeter() as meter:
        meter.tag(state, "state")
        state, _ = step(state, x)
    got = {k: before[k] - v for k, v in ff.unshard(state.params).items()}
    names = [n for n, _ in model.named_parameters()]
    diff = max((got[n] - r).abs().max().item() for n, r in zip(names, reference, strict=True))
    block = plan.unit("blocks.0").gather_bytes(world)
    return diff, meter.category_peaks()["gathered"] / block


def test_a_unit_whose_output_gets_its_gradient_early_is_refilled_in_its_turn(pool):
    # Each block's router output gets its gradient at the start of backward (from the
    # auxiliary loss), its main output only in the block's turn. The refill comes at the
    # first of them to be used; autograd runs ready nodes latest-made first, so a router's
    # backward waits for the blocks after it. Catches: gradients that differ, and a refill
    # at the first gradient to arrive (every block gathered at once when backward starts).
    for diff, blocks_gathered in pool.run(_gathered_with_early_gradients, world=2):
        assert diff < 1e-6
        assert blocks_gathered <= 2, blocks_gathered  # the schedule's two units in flight
