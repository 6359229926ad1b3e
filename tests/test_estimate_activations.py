"""The activation estimate (one step on fake tensors) against the meter on a real step, with and without remat."""

from __future__ import annotations

import pytest
import torch

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from fsdp_fn._activations import LOSS

CFG = GPTConfig(vocab=512, seq=64, d_model=64, n_layers=3, n_heads=4)
BATCH = 8  # per rank
REMAT = {"none": None, "full": ff.Remat(), "save_dots": ff.Remat(policy=ff.save_dots)}
TOLERANCE = 0.02  # activations: estimate within 2% of the meter (measured: equal to the byte)


def _estimate_and_measure(group, remat: str) -> dict[str, object]:
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = GPT(CFG)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]))
    step = ff.train_step(fn, lm_loss, ff.adamw(), schedule=ff.Schedule(), remat=REMAT[remat])
    state = step.init(ff.shard(fn.params, plan, group))
    batch = torch.randint(0, CFG.vocab, (BATCH, CFG.seq + 1), generator=torch.Generator().manual_seed(rank))
    activations = ff.estimate_activations(fn, lm_loss, batch, plan, remat=REMAT[remat])
    # The schedule's default keeps up to two non-root units gathered (prefetch).
    estimate = ff.estimate_memory(plan, world, activations=activations, units_in_flight=ff.Schedule().max_inflight)
    state, _ = step(state, batch)  # warm: nothing is created lazily in the measured step
    with ff.MemoryMeter() as meter:
        meter.tag(state, "state")
        state, _ = step(state, batch)
    peak = meter.peak()
    return {
        "estimate": estimate,
        "activations": meter.category_peaks()["activations"],
        "total": peak["total"],
        "gathered": peak["gathered"],
    }


@pytest.fixture(scope="module")
def runs(pool):
    return {name: pool.run(_estimate_and_measure, name, world=2) for name in REMAT}


@pytest.mark.parametrize("remat", REMAT)
def test_activation_estimate_agrees_with_the_meter(runs, remat):
    for rank in runs[remat]:
        estimated, measured = rank["estimate"].activations, rank["activations"]
        assert abs(estimated - measured) <= TOLERANCE * measured, (remat, estimated, measured)
        # The step's total: no lower than the meter's peak, and above it only by the gathered
        # units the estimate allows in flight (``units_in_flight``) but the peak does not hold.
        over = rank["estimate"].total - rank["total"]
        assert 0 <= over <= rank["estimate"].gathered - rank["gathered"], (remat, over)


def test_remat_lowers_the_estimate_as_the_meter_says(runs):
    estimated = {k: v[0]["estimate"].activations for k, v in runs.items()}
    measured = {k: v[0]["activations"] for k, v in runs.items()}
    assert estimated["full"] < estimated["save_dots"] < estimated["none"]
    assert measured["full"] < measured["save_dots"] < measured["none"]
    for lower, higher in (("full", "none"), ("save_dots", "none"), ("full", "save_dots")):
        saved, saved_measured = estimated[higher] - estimated[lower], measured[higher] - measured[lower]
        assert abs(saved - saved_measured) <= TOLERANCE * measured["none"], (lower, higher)


SCHEDULES = {
    "micro_batches": {"micro_batches": 2},
    "micro_batches_no_sync": {"micro_batches": 2, "reduce_each_micro_batch": False},
    "kept_gathered": {"reshard_after_forward": False},
    "bf16": {"mixed_precision": ff.MixedPrecision(param_dtype=torch.bfloat16)},
    "update_in_backward": {"update_in_backward": True},
}


def _estimate_with_the_schedule(group, name):
    """estimate_memory(schedule=...) (and estimate_activations(mixed_precision=...)) against
    the meter on a real step under that schedule."""
    rank = group.rank()
    schedule = ff.Schedule(**SCHEDULES[name])
    torch.manual_seed(0)
    model = GPT(CFG)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]))
    step = ff.train_step(fn, lm_loss, ff.adamw(), schedule=schedule)
    state = step.init(ff.shard(fn.params, plan, group))
    n = schedule.micro_batches
    batch = torch.randint(0, CFG.vocab, (BATCH * n, CFG.seq + 1), generator=torch.Generator().manual_seed(rank))
    batch = list(batch.chunk(n)) if n > 1 else batch
    one = batch[0] if n > 1 else batch
    acts = ff.estimate_activations(fn, lm_loss, one, plan, mixed_precision=schedule.mixed_precision)
    estimate = ff.estimate_memory(plan, group.size(), activations=acts, schedule=schedule)
    state, _ = step(state, batch)
    with ff.MemoryMeter() as meter:
        meter.tag(state, "state")
        state, _ = step(state, batch)
    return estimate.total, meter.peak()["total"]


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_estimate_follows_the_schedule(pool, name):
    # Measured (CPU, W=2): equal to the byte for micro-batches, no_sync and kept-gathered units;
    # 2% over with bf16 and with update_in_backward. Before the schedule was taken into account
    # the estimate was 9%, 17% and 8% under the peak for the first three, 43% over for bf16.
    for estimated, measured in pool.run(_estimate_with_the_schedule, name, world=2):
        assert measured <= estimated <= 1.05 * measured, (name, estimated, measured)


def _gpt():
    with torch.device("meta"):  # the estimate needs shapes only
        model = GPT(CFG)
    return model, ff.make_plan(model, ff.layer_policy([Block]))


def test_full_remat_keeps_each_block_input_and_recomputes_what_it_would_save():
    model, plan = _gpt()
    fn = ff.functionalize(model)
    batch = torch.zeros(BATCH, CFG.seq + 1, dtype=torch.long)
    plain = ff.estimate_activations(fn, lm_loss, batch, plan)
    full = ff.estimate_activations(fn, lm_loss, batch, plan, remat=True)
    block_input = BATCH * CFG.seq * CFG.d_model * 4
    blocks = [u.name for u in plan.units if u.name.startswith("blocks.")]
    assert set(blocks) <= full.remat  # (and the root's modules, split into units of their own)
    for name in blocks:
        assert full.unit(name).saved == block_input
        # Recomputed in backward: what it would have saved, less its input (held already), plus
        # its output (the next unit's input, the same size).
        assert full.unit(name).recompute == plain.unit(name).saved
        assert plain.unit(name).saved > 4 * block_input
    # The loss keeps its log-softmax (batch x seq x vocab floats; and the targets) either way;
    # the peak is its backward.
    logits = BATCH * CFG.seq * CFG.vocab * 4
    assert logits < plain.unit(LOSS).saved == full.unit(LOSS).saved < 1.01 * logits
    assert full.peak_op == plain.peak_op == "aten._log_softmax_backward_data.default"
    # There, besides what the forward left: the log-softmax's incoming gradient and the logits' gradient.
    for e in (plain, full):
        assert abs(e.peak - (e.saved + 2 * logits)) < 0.01 * logits
    assert full.saved < plain.saved / 3


def test_nothing_is_allocated_and_nothing_is_communicated():
    torch.manual_seed(0)
    model = GPT(CFG)  # real parameters this time: the estimate must not touch their data
    plan = ff.make_plan(model, ff.layer_policy([Block]))
    batch = torch.randint(0, CFG.vocab, (BATCH, CFG.seq + 1))
    fn = ff.functionalize(model)
    with ff.MemoryMeter() as meter, ff.comm_log() as log:
        estimate = ff.estimate_activations(fn, lm_loss, batch, plan, remat=True)
    assert estimate.peak > 0
    assert meter.category_peaks() == dict.fromkeys(ff.CATEGORIES, 0), meter.category_peaks()
    assert log.records == []


def test_the_module_is_left_as_it_was():
    model, plan = _gpt()
    before = {k: (v.shape, v.device) for k, v in model.state_dict().items()}
    ff.estimate_activations(
        ff.functionalize(model), lm_loss, torch.zeros(2, CFG.seq + 1, dtype=torch.long), plan, remat=True
    )
    assert {k: (v.shape, v.device) for k, v in model.state_dict().items()} == before
    for m in model.modules():
        assert "forward" not in m.__dict__
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert all(p.grad is None for p in model.parameters())


def test_a_loss_that_is_not_a_scalar_is_refused_by_name():
    model, plan = _gpt()
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        ff.estimate_activations(
            ff.functionalize(model), lambda m, b: m(b[:, :-1]), torch.zeros(2, 9, dtype=torch.long), plan
        )
    with pytest.raises(TypeError, match="functionalize"):
        ff.estimate_activations(model, lm_loss, torch.zeros(2, 9, dtype=torch.long), plan)


def _merged(group, per_unit, remat=True, sequences=2, vocab=512):
    """Blocks merged ``per_unit`` a unit, every unit rematerialised or none: the estimate's total against the meter."""
    rank = group.rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=vocab, seq=32, d_model=64, n_layers=8, n_heads=2))
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block])).grouped(per_unit)
    chosen = ff.Remat() if remat else None
    step = ff.train_step(fn, lm_loss, ff.adamw(), remat=chosen)
    state = step.init(ff.shard(fn.params, plan, group))
    batch = torch.randint(0, vocab, (sequences, 33), generator=torch.Generator().manual_seed(rank))
    acts = ff.estimate_activations(fn, lm_loss, batch, plan, remat=chosen)
    estimate = ff.estimate_memory(plan, group.size(), activations=acts, schedule=ff.Schedule())
    state, _ = step(state, batch)
    with ff.MemoryMeter() as meter:
        meter.tag(state, "state")
        state, _ = step(state, batch)
    return estimate.total, meter.peak()["total"]


@pytest.mark.parametrize("per_unit", [2, 4])
def test_a_merged_rematerialised_plan_is_estimated_to_the_peak(pool, per_unit):
    # Catches: the first unit's backward (its recomputation, its full gradient, every other unit's
    # gradient shard) counted with a prefetched unit that is not there (nothing runs after it) and
    # the end of backward with every unit still gathered: 8-9% over the meter at 8 blocks a unit on
    # the tiny GPT of bench/planner.py, where the planner weighs remat. Measured now: equal.
    for estimated, measured in pool.run(_merged, per_unit, world=2):
        assert abs(estimated / measured - 1) <= 0.02, (per_unit, estimated, measured)


@pytest.mark.parametrize("per_unit", [2, 4])
def test_the_units_gathered_at_the_loss_are_the_first_ones_backward_runs(pool, per_unit):
    # Catches: the loss and the start of its backward counted with the two largest units gathered
    # (the forward's rule), where the step holds the first unit backward runs and the ones it
    # prefetches beside it: 2.0% and 3.7% over the meter at 2 and 4 blocks a unit. Now equal.
    for estimated, measured in pool.run(_merged, per_unit, False, 8, world=2):
        assert abs(estimated / measured - 1) <= 0.005, (per_unit, estimated, measured)


def test_a_gradient_the_step_takes_as_the_full_one_is_counted_once(pool):
    # Catches: the head's full gradient counted beside autograd's gradient of its one weight, which
    # the step takes as that full gradient (no copy; bench/planner.py's units of one block, with a
    # head of 4096 x 64): 9.6% over the meter with remat. Now equal.
    for estimated, measured in pool.run(_merged, 1, True, 2, 4096, world=2):
        assert abs(estimated / measured - 1) <= 0.005, (estimated, measured)
