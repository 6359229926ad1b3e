"""A toolkit for property tests of sharded training code: real ranks, strategies, parity.

``RankPool`` runs a function on ``W`` real gloo ranks kept alive across calls (spawning
ranks and joining a process group costs seconds; a pool pays that once per session).
``pool.run(fn, *args, world=W)`` calls ``fn(group, *args)`` on ranks ``0..W-1`` with
``group`` a real ``ProcessGroup`` of exactly those ranks (one is made for every size at
start-up), and returns the ranks' results in rank order. A rank that raises, or ranks
that run past the timeout, raise ``RankError`` here with every rank's traceback; a pool
whose ranks may be stuck in a collective is killed and respawned on next use. Inside the
ranks hypothesis runs with a deterministic profile, so every rank draws the same examples.

Hypothesis strategies draw what a sharded run depends on: ``models`` (depths, widths
that divide by no world size, tied and frozen parameters), ``plans`` (unit policies),
``worlds`` and ``layouts`` (world sizes, hybrid sharding). ``assert_matches_unsharded``
trains or differentiates a model sharded and unsharded and raises ``Divergence`` naming
the first step, unit and parameter that differ.

>>> pool = RankPool(2)                                # doctest: +SKIP
>>> pool.run(my_test_fn, 3, world=2)                  # doctest: +SKIP
[result_on_rank0, result_on_rank1]
"""

# The rooms: `_pool` (`RankPool`, `RankError`, `pool_group`), `_strategies` (the specs
# and the strategies that draw them), `_parity` (`assert_matches_unsharded`, `Divergence`,
# `split_batch`).

from fsdp_fn.testing._parity import Divergence, assert_matches_unsharded, split_batch
from fsdp_fn.testing._pool import RankError, RankPool, pool_group
from fsdp_fn.testing._strategies import LayoutSpec, ModelSpec, PlanSpec, StackMLP, layouts, models, plans, worlds

__all__ = [
    "RankPool",
    "RankError",
    "pool_group",
    "assert_matches_unsharded",
    "Divergence",
    "split_batch",
    "models",
    "plans",
    "worlds",
    "layouts",
    "ModelSpec",
    "PlanSpec",
    "LayoutSpec",
    "StackMLP",
]
