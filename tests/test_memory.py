"""ZeRO-3 memory semantics, measured with the meter: shards only, one unit in flight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from tests.helpers import local_part

CFG = GPTConfig(vocab=64, seq=16, d_model=32, n_layers=6, n_heads=2)


def _measured_step(group, split_root=False, update_in_backward=False, reshard_after_forward=True):
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = GPT(CFG)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]), split_root=split_root)
    params = ff.shard(fn.params, plan, group)
    step = ff.train_step(
        fn, lm_loss, ff.adamw(), update_in_backward=update_in_backward, reshard_after_forward=reshard_after_forward
    )
    state = step.init(params)
    batch = local_part(torch.randint(0, CFG.vocab, (4 * world, CFG.seq + 1), generator=torch.Generator().manual_seed(0)), rank, world)
    state, _ = step(state, batch)  # warm: nothing is created lazily in the measured step
    with ff.MemoryMeter() as meter, ff.comm_log() as log:
        meter.tag(state, "state")
        state, _ = step(state, batch)
        meter.sample("after the step")
    estimate = ff.estimate_memory(plan, world, update_in_backward=update_in_backward)
    return {
        "peaks": meter.category_peaks(),
        "after": dict(meter.current),
        "estimate": estimate,
        "plan": plan,
        "all_gathers": len(log.of("all_gather")),
        "shard_bytes": sum(t.numel() * t.element_size() for t in state.params.values()),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_one_unit_in_flight_and_only_shards_after_a_step(pool, world):
    out = pool.run(_measured_step, world=world)[0]
    plan, peaks, est = out["plan"], out["peaks"], out["estimate"]
    root = plan.unit("").gather_bytes(world)
    largest_block = max(u.gather_bytes(world) for u in plan.units if u.name)
    assert len(plan.units) == 7  # root + 6 blocks
    # Gathered parameters never exceed the root plus one block (no prefetch).
    assert peaks["gathered"] <= root + largest_block
    assert peaks["gathered"] > root  # and a block really was gathered
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
    assert lean["peaks"]["grads"] <= full_grad + lean["estimate"].grads
    assert lean["peaks"]["grads"] < plain["peaks"]["grads"]


def test_split_root_lowers_gathered_peak(pool):
    whole = pool.run(_measured_step, world=2)[0]
    split = pool.run(_measured_step, world=2, split_root=True)[0]
    assert "" not in split["plan"].unit_names
    largest = max(u.gather_bytes(2) for u in split["plan"].units)
    assert split["peaks"]["gathered"] <= largest
    assert split["peaks"]["gathered"] < whole["peaks"]["gathered"]


def test_keep_gathered_trades_memory_for_one_all_gather_per_unit(pool):
    resharded = pool.run(_measured_step, world=2)[0]
    kept = pool.run(_measured_step, world=2, reshard_after_forward=False)[0]
    blocks = sum(1 for u in kept["plan"].units if u.name)
    assert resharded["all_gathers"] - kept["all_gathers"] == blocks
    assert kept["peaks"]["gathered"] > resharded["peaks"]["gathered"]


# --- meta-device initialisation ------------------------------------------------------------------


def _meta_init(group, seed=3):
    with torch.device("meta"):
        model = GPT(CFG)
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
    params, _ = ff.init_shards(m, plan, group, init=lambda mod: [nn.init.ones_(p) for p in mod.parameters(recurse=False)])
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
    assert est.optimizer == 2 * est.params + 4 * len(plan.units)
    assert est.gathered == plan.unit("").gather_bytes(4) + plan.unit("blocks.0").gather_bytes(4)
    lean = ff.estimate_memory(plan, 4, update_in_backward=True, optimizer_slots=1)
    assert lean.grads == max(u.shard_numel(4) for u in plan.units) * 4
    assert lean.optimizer == est.params + 4 * len(plan.units)
