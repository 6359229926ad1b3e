"""Defaults that win: a root larger than every other unit is split by default, and that lowers the peak."""

from __future__ import annotations

import torch

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig
from tests.helpers import gpt_state, local_part, make

# A language model whose embedding and head (2 x 512 x 32) outweigh a block (~12.7k parameters).
WIDE_VOCAB = GPTConfig(vocab=512, seq=16, d_model=32, n_layers=4, n_heads=2)
NARROW_VOCAB = GPTConfig(vocab=64, seq=16, d_model=32, n_layers=4, n_heads=2)


def test_the_root_is_split_by_default_only_when_it_is_the_largest_unit():
    with torch.device("meta"):
        wide, narrow = GPT(WIDE_VOCAB), GPT(NARROW_VOCAB)
    policy = ff.layer_policy([Block])
    plan = ff.make_plan(wide, policy)
    assert "" not in plan.unit_names  # split: wte, wpe, ln_f and head are units of their own
    assert {"wte", "head"} <= set(plan.unit_names)
    assert plan.unit_names == ff.make_plan(wide, policy, split_root=True).unit_names
    assert "" in ff.make_plan(wide, policy, split_root=False).unit_names  # an explicit choice stands
    small_root = ff.make_plan(narrow, policy)
    assert small_root.unit_names[0] == "" and len(small_root.units) == 5  # root + 4 blocks, as before
    assert ff.make_plan(wide).unit_names == ("",)  # no policy: one unit, on purpose


def _peak(group, split_root):
    world, rank = group.size(), group.rank()
    _, step, state = gpt_state(group, WIDE_VOCAB, split_root=split_root)
    batch = local_part(
        torch.randint(0, WIDE_VOCAB.vocab, (2 * world, WIDE_VOCAB.seq + 1), generator=torch.Generator().manual_seed(0)),
        rank,
        world,
    )
    state, _ = step(state, batch)
    with ff.MemoryMeter() as meter:
        meter.tag(state, "state")
        step(state, batch)
    return meter.peak()["total"]


def test_splitting_a_large_root_lowers_the_peak(pool):
    kept, split = (pool.run(_peak, split_root, world=2)[0] for split_root in (False, True))
    assert split < kept


def _logged_summary(group):
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("fsdp_fn")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    try:
        model, policy, loss_fn = make("gpt")
        fn = ff.functionalize(model)
        plan = ff.make_plan(model, policy)
        params = ff.shard(fn.params, plan, group)
        quiet = ff.train_step(fn, loss_fn, ff.adamw())
        quiet.init(params)  # the logger's level is not set: INFO is not logged
        silent = list(records)
        logger.setLevel(logging.INFO)
        step = ff.train_step(
            fn, loss_fn, ff.adamw(), schedule=ff.Schedule(update_in_backward=True), remat=True, compile=True
        )
        step.init(params)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return silent, records, len(plan.units)


def test_init_logs_a_one_line_summary_when_asked(pool):
    # Catches: a summary printed by default (a library stays quiet unless configured), or one that
    # leaves out the plan, the schedule's choices, remat or compilation.
    for silent, records, units in pool.run(_logged_summary, world=2):
        assert silent == []
        assert len(records) == 1 and "\n" not in records[0], records
        line = records[0]
        assert line.startswith(f"fsdp_fn: {units} units") and "world 2" in line, line
        assert "'update_in_backward': True" in line and "remat: save_nothing, every 1" in line, line
        assert "compile: on" in line and "optimizer: adamw" in line, line
