"""Every collective a step issues is counted, and equals what the plan predicts."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import fsdp_fn as ff
from examples.gpt import GPTConfig
from tests.helpers import gpt_state, local_part, rows_fetched

CFG = GPTConfig(vocab=50, seq=8, d_model=12, n_layers=4, n_heads=2)


def _logged_steps(group, split_root, step_kw):
    with rows_fetched():  # (this GPT's tables are small: a step would gather them)
        return _logged_steps_fetching(group, split_root, step_kw)


def _logged_steps_fetching(group, split_root, step_kw):
    world, rank = group.size(), group.rank()
    plan, step, state = gpt_state(group, CFG, split_root=split_root, **step_kw)
    logs = []
    for k in range(2):
        batch = local_part(
            torch.randint(0, CFG.vocab, (2 * world, CFG.seq + 1), generator=torch.Generator().manual_seed(k)),
            rank,
            world,
        )
        with ff.comm_log() as log:
            state, _ = step(state, batch)
        logs.append(log.records)
    return plan, logs


def key(c):
    return (c.op, c.unit, c.numel, c.dtype)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("split_root", [False, True])
@pytest.mark.parametrize("variant", ["default", "keep_gathered", "last_kept_only", "in_backward_no_prefetch"])
def test_step_issues_exactly_the_predicted_collectives(pool, world, split_root, variant):
    step_kw = {
        "default": {},
        "keep_gathered": {"reshard_after_forward": False},
        "last_kept_only": {"keep_tail_gathered": False},
        "in_backward_no_prefetch": {"update_in_backward": True, "backward_prefetch": None, "forward_prefetch": False},
    }[variant]
    results = pool.run(_logged_steps, split_root, step_kw, world=world)
    plan = results[0][0]
    schedule = ff.Schedule(**step_kw)
    for _, logs in results:  # every rank issues the same
        for k, records in enumerate(logs):
            with rows_fetched():
                predicted = ff.predict_collectives(plan, world, schedule, first_step=k == 0)
            assert Counter(map(key, records)) == Counter(map(key, predicted))
            # one collective per unit per phase: forward all-gathers run in plan order, and so do
            # the embeddings' row fetches
            embeddings = {"wte", "wpe"} if split_root else set()
            dense = [u for u in plan.units if u.name not in embeddings]
            forward = [c.unit for c in records if c.op == "all_gather"][: len(dense)]
            assert forward == [u.name for u in dense]
            assert [c.unit for c in records if c.op == "row_fetch"] == [u for u in plan.unit_names if u in embeddings]
            # Bytes: 3 x (W-1)/W x parameter bytes (gather, gather again in backward, reduce-scatter),
            # less one gather per unit kept gathered, derived from the plan alone: every unit with
            # reshard_after_forward=False; otherwise the root, and from the second step on the units
            # that run last (their backward comes first) while their bytes fit the in-flight cap,
            # twice the largest unit's (the last one always; it alone without a backward prefetch
            # or with keep_tail_gathered=False). The embeddings (units of their own when the root is
            # split) are never gathered: their rows are fetched and their rows' gradients sent back
            # (row_fetch, row_reduce: sized by the token ids, not the table).
            # Catches: a unit re-gathered that need not be, a kept unit that is freed, a wrong byte
            # count, an embedding's table gathered or reduce-scattered.
            assert {u.name for u in plan.units if u.lookup} == embeddings
            assert {c.unit for c in records if c.op.startswith("row_")} == embeddings
            if variant == "keep_gathered":
                kept_units = set(plan.unit_names) - embeddings
            else:
                kept_units = {u for u in plan.unit_names if u == ff.ROOT}
                if k > 0:
                    cap = 2 * max(u.padded_numel(world) * 4 for u in plan.units if u.name != ff.ROOT)
                    tail = [u for u in plan.units if u.name != ff.ROOT]
                    kept_units.add(tail.pop().name)
                    while (
                        schedule.backward_prefetch
                        and schedule.keep_tail_gathered
                        and tail
                        and sum(
                            u.padded_numel(world) * 4
                            for u in plan.units
                            if u.name in kept_units | {tail[-1].name} and u.name != ff.ROOT
                        )
                        <= cap
                    ):
                        kept_units.add(tail.pop().name)
            param_bytes = sum(u.padded_numel(world) * 4 for u in dense)
            kept = sum(u.padded_numel(world) * 4 for u in dense if u.name in kept_units)
            # (the units' parameters, not the metrics nor update_in_backward's masks, counted below)
            sent = sum(c.ring_bytes for c in records if c.unit is not None and c.op != "all_reduce")
            assert sent == pytest.approx((3 * param_bytes - kept) * (world - 1) / world)
            # update_in_backward: which parameters any rank reached, merged before each unit's update
            masks = [(c.unit, c.numel) for c in records if c.op == "all_reduce"]
            stepped = [(u.name, len(u.params)) for u in plan.units if u.params]
            assert sorted(masks) == (sorted(stepped) if schedule.update_in_backward else [])
            backward = records[len(plan.units) :]
            backward_gathers = {c.unit for c in backward if c.op == "all_gather" and c.unit is not None}
            assert backward_gathers == set(plan.unit_names) - kept_units - embeddings
