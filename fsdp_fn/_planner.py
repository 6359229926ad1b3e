"""A plan that chooses itself: how many blocks a unit holds, and remat, from measured costs under a budget.

Each unit costs a few round trips and some host work per step whatever its size; merging
consecutive blocks into one unit (``Plan.grouped``) pays them once for all, at the price of
more parameters gathered at once. ``measure_costs`` times what those choices trade (the
group's collectives at two sizes, and the step itself at the two ends of the grouping, with
and without remat), the same numbers on every rank. ``plan_for_budget`` predicts each
candidate's step time from them and its peak from ``estimate_memory`` and
``estimate_activations``, and picks the fastest that fits. The result is ordinary data: a
``Plan`` and a remat choice, serialisable, the same on every rank, reusable without measuring.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fsdp_fn._activations import estimate_activations
from fsdp_fn._base import GradientTransformation
from fsdp_fn._collectives import all_gather_into, reduce_scatter
from fsdp_fn._functional import Functional
from fsdp_fn._group import Group, Role, resolve_axes
from fsdp_fn._memory import estimate_memory
from fsdp_fn._optim import adamw
from fsdp_fn._plan import Plan, unit_label
from fsdp_fn._policy import Schedule
from fsdp_fn._shard import shard
from fsdp_fn._step import train_step

_SIZES = (1 << 10, 1 << 16)  # float32 elements of the timed collectives: latency, then bandwidth
_MOST_STEPS = 50  # timed steps per configuration and pass, at most


@dataclass(frozen=True)
class StepCosts:
    """What ``measure_costs`` timed, in seconds, agreed on every rank (each the slowest rank's).

    Attributes:
        world: ranks of the shard group the costs were measured on.
        blocks: how many of the plan's units may be merged (its module-owned units in a run).
        step_s: the step with one unit per block, and with every block in one unit.
        units: how many units those two plans have.
        per_unit_s: what one unit more costs a step (round trips and host work): the slope.
        remat_s: what rematerialising one block adds to a step (its forward again), measured
            at both ends (one unit a block, all in one).
        kept_s: what keeping a unit gathered from its forward to its backward saves a step
            (``reshard_after_forward=False``: one all-gather less), measured at one unit a block.
        all_gather_s, reduce_scatter_s: one collective of ``_SIZES`` float32 elements each:
            the latency, and with the larger size the bandwidth.
    """

    world: int
    blocks: int
    step_s: tuple[float, float]
    units: tuple[int, int]
    per_unit_s: float
    remat_s: tuple[float, float]
    kept_s: float
    all_gather_s: tuple[float, float]
    reduce_scatter_s: tuple[float, float]

    def step(self, units: int, remat: bool = False, kept: bool = False) -> float:
        """The predicted step of a plan of ``units`` units: the all-in-one step's plus
        ``per_unit_s`` for each unit more; with ``remat`` every block's recomputation (its cost
        per block interpolated between the ends by the number of units); with ``kept``,
        ``kept_s`` less for each unit."""
        more = units - self.units[1]
        at = more / (self.units[0] - self.units[1])  # 0: all in one, 1: one unit a block
        recompute = self.blocks * (self.remat_s[1] + at * (self.remat_s[0] - self.remat_s[1])) if remat else 0.0
        return self.step_s[1] + self.per_unit_s * more + recompute - (self.kept_s * units if kept else 0.0)

    def to_dict(self) -> dict[str, Any]:
        """The costs as JSON-able data (``StepCosts(**d)`` reads it back, tuples from lists)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepCosts:
        """The costs ``to_dict`` wrote."""
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**fields)


def measure_costs(
    fn: Functional,
    loss_fn: Callable[..., torch.Tensor],
    batch: Any,
    plan: Plan,
    group: Group = None,
    *,
    optimizer: GradientTransformation | None = None,
    steps: int = 3,
    seconds: float = 1.0,
) -> StepCosts:
    """Time what the grouping and remat trade, on this rank's ``batch``, once.

    Runs the train step on fresh shards of ``fn``'s parameters (the module's are not
    changed) for the plan with one unit per block and for all blocks in one unit, and with
    remat; and four collectives of ``_SIZES``. The five configurations are timed in two
    passes, the second in the reverse order, so that a machine whose speed drifts during the
    measurement weighs on each alike; in each pass a configuration gets one step to warm up,
    then half its timed steps: ``steps`` in all, or as many more as last about ``seconds``
    (the same number on every rank). Each figure is the median of its timed steps, the
    slowest rank's, so every rank holds the same costs. Memory: one more sharded state at a
    time (parameters, optimizer state); communication: what those steps do, and the timed
    collectives.

    Args:
        fn: the model, from ``functionalize(module)``.
        loss_fn: the step's ``loss_fn(model, batch)``.
        batch: this rank's part of a typical batch.
        plan: a unit per block (``make_plan(model, layer_policy([Block]))``).
        group: the ranks that shard together, as for ``shard``.
        optimizer: the step's optimizer (``adamw()`` when ``None``).
        steps: the fewest timed steps per configuration (half in each pass, rounded up).
        seconds: about how long each configuration's timed steps last in all (a fast step
            is timed more often; ``0``: ``steps`` steps).

    Returns:
        The ``StepCosts``.

    Raises:
        ValueError: if the plan has fewer than two units that can be merged, ``steps`` is
            below one or ``seconds`` negative.
    """
    if steps < 1 or seconds < 0:
        raise ValueError(
            f"measure_costs times at least one step a configuration for a time of zero seconds or more: "
            f"got steps={steps}, seconds={seconds}"
        )
    blocks = _mergeable(plan)
    if blocks < 2:
        raise ValueError(f"measure_costs needs a plan with two or more blocks to merge, got {list(plan.unit_names)}")
    axes = resolve_axes(group)
    shard_group = next(a.group for a in axes if a.role is Role.SHARD)
    optimizer = optimizer or adamw()
    ends = (plan, plan.grouped(blocks))

    def timed(p: Plan, remat: bool, kept: bool, into: list[float]) -> None:
        schedule = Schedule(reshard_after_forward=not kept)
        step = train_step(fn, loss_fn, optimizer, schedule=schedule, remat=remat or None, check_schedule="never")
        state = step.init(shard(fn.params, p, group))
        start = time.perf_counter()
        state, _ = step(state, batch)
        (warm,) = _slowest([time.perf_counter() - start], shard_group)  # (every rank runs as many steps)
        for _ in range(max(math.ceil(steps / 2), min(_MOST_STEPS, math.ceil(seconds / 2 / max(warm, 1e-9))))):
            start = time.perf_counter()
            state, _ = step(state, batch)
            into.append(time.perf_counter() - start)

    configs = [(p, remat, False) for remat in (False, True) for p in ends] + [(ends[0], False, True)]
    times: list[list[float]] = [[] for _ in configs]
    for order in (range(len(configs)), reversed(range(len(configs)))):
        for i in order:
            timed(*configs[i], times[i])
    local = [statistics.median(t) for t in times]
    local += [_collective(op, n, shard_group) for op in ("all_gather", "reduce_scatter") for n in _SIZES]
    one, all_in_one, one_remat, all_remat, one_kept, *collectives = _slowest(local, shard_group)
    units = (len(ends[0].units), len(ends[1].units))
    return StepCosts(
        world=shard_group.size(),
        blocks=blocks,
        step_s=(one, all_in_one),
        units=units,
        per_unit_s=max(0.0, (one - all_in_one) / (units[0] - units[1])),
        remat_s=(max(0.0, (one_remat - one) / blocks), max(0.0, (all_remat - all_in_one) / blocks)),
        kept_s=max(0.0, (one - one_kept) / units[0]),
        all_gather_s=(collectives[0], collectives[1]),
        reduce_scatter_s=(collectives[2], collectives[3]),
    )


def _mergeable(plan: Plan) -> int:
    """The largest number of consecutive units ``Plan.grouped`` may merge: the longest run it finds."""
    merged = plan.grouped(len(plan.units))
    return max((len(u.members) for u in merged.units if u.members), default=1)


def _slowest(seconds: list[float], group: dist.ProcessGroup) -> list[float]:
    """Each of ``seconds``, the largest any rank holds (one all-gather), the same on every rank."""
    mine = torch.tensor(seconds, dtype=torch.float64)
    everyone = mine.new_empty(mine.numel() * group.size())
    all_gather_into(everyone, mine, group, None)
    return everyone.view(group.size(), -1).amax(0).tolist()


def _collective(op: str, n: int, group: dist.ProcessGroup, reps: int = 5) -> float:
    """The median time of ``reps`` blocking ``op`` calls on ``n`` float32 elements per rank."""
    world = group.size()
    shard_ = torch.zeros(n)
    full = torch.zeros(n * world)
    times = []
    for _ in range(reps + 1):  # (the first warms up)
        start = time.perf_counter()
        if op == "all_gather":
            all_gather_into(full, shard_, group, None)
        else:
            reduce_scatter(full, group, None)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


@dataclass(frozen=True)
class Candidate:
    """One plan the planner weighed: ``per_unit`` blocks a unit, remat or not, units kept gathered
    from forward to backward or not (``reshard_after_forward=False``), and its predictions."""

    per_unit: int
    remat: bool
    kept: bool
    units: int
    step_s: float
    peak_bytes: int
    largest_unit: str
    fits: bool


@dataclass(frozen=True)
class PlanChoice:
    """The planner's answer: an ordinary ``Plan``, a remat choice and a schedule, with what it predicted.

    Attributes:
        plan: the chosen plan (``per_unit`` blocks merged into each unit).
        remat: whether every non-root unit is rematerialised (``train_step(..., remat=True)``).
        kept: whether the units stay gathered from forward to backward (step with
            ``schedule_for(...)``: ``reshard_after_forward=False``).
        budget: the per-rank bytes it had to fit.
        costs: the measured costs the predictions came from.
        candidates: every plan weighed, fastest first.
    """

    plan: Plan
    remat: bool
    kept: bool
    budget: int | None
    costs: StepCosts
    candidates: tuple[Candidate, ...] = field(default=())

    def schedule_for(self, schedule: Schedule | None = None) -> Schedule:
        """``schedule`` (the default one when ``None``) with the choice's resharding after forward."""
        return dataclasses.replace(schedule or Schedule(), reshard_after_forward=not self.kept)

    @property
    def chosen(self) -> Candidate:
        """The chosen candidate's predictions."""
        return next(c for c in self.candidates if c.fits)

    def explain(self) -> str:
        """Every candidate with its predicted step and peak, the chosen one marked, and why."""
        c = self.chosen
        budget = "none" if self.budget is None else f"{self.budget / 2**20:.1f} MiB"
        rows = [
            f"plan: {c.per_unit} blocks a unit ({c.units} units), remat {'on' if c.remat else 'off'}, "
            f"{'kept gathered' if c.kept else 'resharded'} after forward: predicted step {c.step_s * 1e3:.1f} ms, "
            f"peak {c.peak_bytes / 2**20:.1f} MiB (budget {budget})",
            f"costs (slowest rank, W={self.costs.world}): each unit {self.costs.per_unit_s * 1e3:.2f} ms a step, "
            f"kept gathered {self.costs.kept_s * 1e3:.2f} ms less; remat {self.costs.remat_s[0] * 1e3:.2f} ms a block "
            f"({self.costs.remat_s[1] * 1e3:.2f} all in one); all-gather {self.costs.all_gather_s[0] * 1e6:.0f} us "
            f"(4 KiB) / {self.costs.all_gather_s[1] * 1e6:.0f} us (256 KiB)",
            f"{'blocks/unit':>11} {'units':>5} {'remat':>5} {'kept':>5} {'step ms':>8} {'peak MiB':>9}  largest unit",
        ]
        for k in self.candidates:
            mark = " <- chosen" if k == c else ("" if k.fits else "  (over the budget)")
            rows.append(
                f"{k.per_unit:>11} {k.units:>5} {'on' if k.remat else 'off':>5} {'yes' if k.kept else 'no':>5} "
                f"{k.step_s * 1e3:>8.1f} {k.peak_bytes / 2**20:>9.1f}  {unit_label(k.largest_unit)}{mark}"
            )
        rows.append(
            "why: the fastest predicted step whose predicted peak fits; fewer units pay fewer round trips, "
            "larger ones gather more at once"
        )
        return "\n".join(rows)

    def to_dict(self) -> dict[str, Any]:
        """The choice as JSON-able data: the plan, remat, budget, costs and candidates."""
        return {
            "plan": self.plan.to_dict(),
            "remat": self.remat,
            "kept": self.kept,
            "budget": self.budget,
            "costs": self.costs.to_dict(),
            "candidates": [asdict(c) for c in self.candidates],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanChoice:
        """The choice ``to_dict`` wrote."""
        return cls(
            Plan.from_dict(data["plan"]),
            data["remat"],
            data["kept"],
            data["budget"],
            StepCosts.from_dict(data["costs"]),
            tuple(Candidate(**c) for c in data["candidates"]),
        )


def plan_for_budget(
    fn: Functional,
    loss_fn: Callable[..., torch.Tensor],
    batch: Any,
    plan: Plan,
    costs: StepCosts,
    budget: int | None = None,
    *,
    schedule: Schedule | None = None,
    optimizer_slots: int = 2,
) -> PlanChoice:
    """The fastest plan predicted to fit ``budget`` bytes per rank: blocks per unit, remat, and
    whether units stay gathered from forward to backward.

    Weighs ``1, 2, 4, ...`` blocks a unit (and all of them in one), each with and without
    remat, each resharded after forward or kept gathered: its step from ``costs``
    (``StepCosts.step``), its peak from ``estimate_memory`` with ``estimate_activations`` on
    ``batch`` (fake tensors: nothing allocated, nothing communicated). The same inputs give
    the same choice on every rank.

    Args:
        fn: the model, from ``functionalize(module)``.
        loss_fn: the step's ``loss_fn(model, batch)``.
        batch: this rank's part of a typical batch.
        plan: a unit per block, as ``measure_costs`` was given.
        costs: ``measure_costs``'s.
        budget: the most bytes per rank the step may hold at its peak; ``None``: no limit
            (the fastest plan).
        schedule: the step's schedule (the default one when ``None``).
        optimizer_slots: shard-sized optimizer tensors per parameter (AdamW 2).

    Returns:
        The ``PlanChoice``; ``explain()`` prints it.

    Raises:
        ValueError: if no candidate fits ``budget``, naming the smallest budget that would
            and the unit that sets it.
    """
    schedule = schedule or Schedule()
    sizes, k = [], 1
    while k < costs.blocks:
        sizes.append(k)
        k *= 2
    sizes.append(costs.blocks)
    candidates = []
    for per_unit in sizes:
        grouped = plan.grouped(per_unit)
        largest = max((u for u in grouped.units if u.name), key=lambda u: u.gather_bytes())
        for remat in (False, True):
            acts = estimate_activations(fn, loss_fn, batch, grouped, remat=remat or None)
            for kept in (False, True):
                peak = estimate_memory(
                    grouped,
                    costs.world,
                    activations=acts,
                    schedule=dataclasses.replace(schedule, reshard_after_forward=not kept),
                    optimizer_slots=optimizer_slots,
                ).total
                units = len(grouped.units)
                candidates.append(
                    Candidate(
                        per_unit,
                        remat,
                        kept,
                        units,
                        costs.step(units, remat, kept),
                        peak,
                        largest.name,
                        budget is None or peak <= budget,
                    )
                )
    candidates.sort(key=lambda c: (c.step_s, c.peak_bytes))
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        least = min(candidates, key=lambda c: c.peak_bytes)
        raise ValueError(
            f"no plan fits the budget of {budget} bytes per rank: the smallest predicted peak is "
            f"{least.peak_bytes} bytes ({least.per_unit} blocks a unit, remat {'on' if least.remat else 'off'}, "
            f"{'kept gathered' if least.kept else 'resharded'} after forward), "
            f"its largest unit {unit_label(least.largest_unit)}; give at least that budget, or more ranks"
        )
    best = fitting[0]
    return PlanChoice(plan.grouped(best.per_unit), best.remat, best.kept, budget, costs, tuple(candidates))
