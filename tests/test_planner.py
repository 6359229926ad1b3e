"""The planner: costs measured once and agreed on every rank, the fastest plan under a budget."""

from __future__ import annotations

import json

import pytest
import torch

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss


def _setup(rank, layers=4):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq=16, d_model=16, n_layers=layers, n_heads=2))
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]), split_root=False)
    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    return fn, plan, batch


def _plan_everywhere(group):
    fn, plan, batch = _setup(group.rank())
    costs = ff.measure_costs(fn, lm_loss, batch, plan, group, steps=1, seconds=0)
    fastest = ff.plan_for_budget(fn, lm_loss, batch, plan, costs)
    peaks = sorted({c.peak_bytes for c in fastest.candidates})
    budget = peaks[len(peaks) // 2]  # some candidates fit, some do not
    tight = ff.plan_for_budget(fn, lm_loss, batch, plan, costs, budget)
    try:
        ff.plan_for_budget(fn, lm_loss, batch, plan, costs, peaks[0] - 1)
        refused = None
    except ValueError as e:
        refused = str(e)
    # the chosen plan, metered: no more than it predicted
    step = ff.train_step(fn, lm_loss, ff.adamw(), remat=tight.remat or None, schedule=tight.schedule_for())
    state, _ = step(step.init(ff.shard(fn.params, tight.plan, group)), batch)
    with ff.MemoryMeter() as meter:
        meter.tag(state, "state")  # (made before the meter: counted by tagging)
        state, _ = step(state, batch)
    return {
        "costs": costs.to_dict(),
        "fastest": fastest.to_dict(),
        "tight": tight.to_dict(),
        "explain": tight.explain(),
        "budget": budget,
        "peaks": peaks,
        "refused": refused,
        "metered": meter.peak()["total"],
    }


def test_the_plan_is_the_same_on_every_rank_and_the_fastest_that_fits(pool):
    # Catches: costs that differ between ranks (each rank would plan its own units: a hang),
    # a choice over the budget, a refusal that names no budget, a choice that is not data.
    results = pool.run(_plan_everywhere, world=2)
    first = results[0]
    for other in results[1:]:
        assert other["costs"] == first["costs"] and other["tight"] == first["tight"]
    costs = ff.StepCosts.from_dict(first["costs"])
    assert costs.world == 2 and costs.blocks == 4 and costs.units == (5, 2)
    assert costs.step(costs.units[1]) == pytest.approx(costs.step_s[1])
    # the slope runs through both ends; a unit never costs less than nothing (on a noisy clock the
    # plan of more units may time faster: then the slope is flat, at the all-in-one step)
    assert costs.per_unit_s >= 0
    assert costs.step(costs.units[0]) == pytest.approx(max(costs.step_s))
    assert costs.step(costs.units[0], remat=True) == pytest.approx(max(costs.step_s) + 4 * costs.remat_s[0])
    assert costs.step(costs.units[1], remat=True) == pytest.approx(costs.step_s[1] + 4 * costs.remat_s[1])
    fastest, tight = (ff.PlanChoice.from_dict(json.loads(json.dumps(first[k]))) for k in ("fastest", "tight"))
    assert fastest.chosen == min(fastest.candidates, key=lambda c: c.step_s)
    assert {(c.per_unit, c.remat, c.kept) for c in fastest.candidates} == {
        (k, r, kept) for k in (1, 2, 4) for r in (False, True) for kept in (False, True)
    }
    assert tight.chosen.peak_bytes <= first["budget"]
    fitting = [c for c in tight.candidates if c.peak_bytes <= first["budget"]]
    assert tight.chosen == min(fitting, key=lambda c: c.step_s)
    assert any(not c.fits for c in tight.candidates)
    assert tight.plan == ff.PlanChoice.from_dict(first["tight"]).plan
    assert "<- chosen" in first["explain"] and "(over the budget)" in first["explain"]
    assert first["refused"] is not None
    assert f"the smallest predicted peak is {first['peaks'][0]} bytes" in first["refused"]
    assert "its largest unit" in first["refused"]
    assert abs(first["metered"] / tight.chosen.peak_bytes - 1) <= 0.05  # the prediction, metered


def test_measuring_needs_blocks_to_merge():
    fn, plan, batch = _setup(0, layers=1)
    with pytest.raises(ValueError, match="needs a plan with two or more blocks to merge"):
        ff.measure_costs(fn, lm_loss, batch, ff.make_plan(fn.module), None)


@pytest.mark.parametrize(("steps", "seconds"), [(0, 0.0), (2, -1.0)])
def test_measuring_needs_a_step_and_a_time_of_zero_or_more(steps, seconds):
    # Catches: no timed step at all (a median of nothing, statistics' words instead of ours).
    fn, plan, batch = _setup(0)
    with pytest.raises(ValueError, match=f"got steps={steps}, seconds={seconds}"):
        ff.measure_costs(fn, lm_loss, batch, plan, None, steps=steps, seconds=seconds)


def _measured_configs(group, seconds):
    """What measure_costs timed, in order: (units, remat, kept gathered, steps run) per configuration."""
    import time

    import fsdp_fn._planner as planner

    fn, plan, batch = _setup(group.rank())
    runs = []
    real_step, real_shard = planner.train_step, planner.shard

    def loss(model, b):
        runs[-1][3] += 1
        if seconds:
            time.sleep(0.01)
        return lm_loss(model, b)

    def step(fn_, loss_fn, optimizer, *, schedule, remat, **kwargs):
        runs.append([None, bool(remat), not schedule.reshard_after_forward, 0])
        return real_step(fn_, loss_fn, optimizer, schedule=schedule, remat=remat, **kwargs)

    def shard(params, p, g):
        runs[-1][0] = len(p.units)
        return real_shard(params, p, g)

    planner.train_step, planner.shard = step, shard
    try:
        ff.measure_costs(fn, loss, batch, plan, group, steps=2, seconds=seconds)
    finally:
        planner.train_step, planner.shard = real_step, real_shard
    return [tuple(r) for r in runs]


def test_costs_are_timed_in_two_passes_the_second_reversed_as_long_as_asked(pool):
    # Catches: configurations timed once, one after another (a machine whose speed drifts
    # weighs on the last ones only); a floor on the time that ranks count differently (each
    # would run its own number of steps: a hang); ``seconds`` ignored.
    short = pool.run(_measured_configs, 0, world=2)
    first = [(5, False, False), (2, False, False), (5, True, False), (2, True, False), (5, False, True)]
    assert short[0] == short[1]
    assert [r[:3] for r in short[0]] == first + first[::-1]
    assert all(r[3] == 1 + 1 for r in short[0])  # a step to warm up, then half of ``steps``
    # (a warm-up step slower than half of ``seconds`` times one step: 0.75 s leaves room for a
    # machine that stalls a step under load)
    long = pool.run(_measured_configs, 1.5, world=2)
    assert long[0] == long[1]  # every rank ran as many steps
    assert [r[:3] for r in long[0]] == first + first[::-1]
    assert all(r[3] > 1 + 1 for r in long[0])  # more steps, to last about ``seconds``
