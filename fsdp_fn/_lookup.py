"""A lookup unit's rows, fetched from the ranks that hold them instead of gathering its table.

A plain ``nn.Embedding`` (``Unit.lookup``) reads only the rows its indices name. In the
lean pass, over a pairwise comm (gloo's sends, ``Comm.pairwise``), its forward fetches just those rows: every rank
tells every other how many distinct indices it looks up and which, each answers with the
elements of those rows that lie in its shard (a row that crosses a slot edge comes in two
pieces), and the module computes ``F.embedding`` on the rows it got, indexed by position.
Backward sends each element of the rows' gradient to the rank that holds it, which sums
what it receives in rank order into a zero gradient shard and scales it by 1/W: the very
numbers the reduce-scatter of the table's dense gradient gives (a row that no rank looked
up is an exact zero either way, and a row's gradient sums its positions in the same order).

Communication per call and rank: three small exchanges in forward (counts, indices, the
rows' elements) and one in backward (the rows' gradient), instead of the whole table
twice (W=2, bench GPT: 16 MiB gathered and 16 MiB reduce-scattered per step, against
2x256 rows of 2 KiB). Memory: the rows, not the table.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import FunctionCtx

from fsdp_fn import _guard
from fsdp_fn._collectives import comm_of, record
from fsdp_fn._function import plain_apply
from fsdp_fn._labels import label
from fsdp_fn._plan import Plan, Unit, unit_label
from fsdp_fn._policy import Schedule
from fsdp_fn._shard import Sharded
from fsdp_fn._unit import UnitState

ROWS_MIN_BYTES = 1 << 20
"""A table smaller than this is gathered: fetching rows costs three round trips in forward, on the
step's critical path (the indices are data), where a gather of a small table is prefetched and
costs next to nothing (``python bench/overhead.py``: the tiny GPT's 128 KiB table)."""


def rows_fit(unit: Unit, schedule: Schedule, replicas: int = 1, world: int = 2) -> bool:
    """Whether the schedule lets a lookup unit fetch its rows: a table of at least
    ``ROWS_MIN_BYTES`` gathered, its shard used as it is (no cast, no offload), reduced per
    micro-batch (not summed first), without replicas. The train step adds what only a call
    knows: a pairwise comm (``Comm.pairwise``), CPU shards, no transform, no remat, no hook, no
    ``max_norm`` or ``sparse``."""
    summed = schedule.micro_batches > 1 and not schedule.reduce_each_micro_batch
    return (
        unit.lookup
        and replicas == 1
        and not summed
        and schedule.cpu_offload is None
        and schedule.gather_dtype(unit.dtype) == unit.dtype == schedule.reduce_dtype(unit.dtype)
        and unit.gather_bytes(world) >= ROWS_MIN_BYTES
    )


def fetchable(
    plan: Plan,
    params: Sharded,
    schedule: Schedule,
    modules: Mapping[str, nn.Module],
    *,
    rematerialised: Collection[str],
    compiled: Collection[int],
    composable: bool,
    deferred: bool,
) -> frozenset[str]:
    """The lookup units that may fetch their rows, as far as what is the same at every call
    decides (``Wiring`` asks once): ``rows_fit``, over a pairwise comm (the group's ``Comm.pairwise``), on CPU (not yet
    measured on accelerators), on the lean pass, not summing micro-batches' full gradients, not
    rematerialised or compiled, not renormalising rows or making sparse gradients.
    ``LookupChoice`` adds what only a call knows."""
    world = params.group.size()
    if composable or world == 1 or deferred or not comm_of(params.group).pairwise:
        return frozenset()
    return frozenset(
        u.name
        for u in plan.units
        if u.lookup
        and rows_fit(u, schedule, params.layout.replicas, world)
        and params[u.name].device.type == "cpu"
        and u.name not in rematerialised
        and modules[u.name].max_norm is None
        and not modules[u.name].sparse
        and id(modules[u.name]) not in compiled
    )


class LookupChoice:
    """For one call: which lookup units fetch their rows instead of gathering their table, and
    whose backward reads the gathered table (so it is gathered again). The one place both are
    decided: ``fetchable`` (made once) and, here, what only the call knows (a hook of the user's
    on the module, a transform, a torch checkpoint region that runs it again in backward)."""

    def __init__(
        self,
        lookups: frozenset[str],
        modules: Mapping[str, nn.Module],
        fetchable: frozenset[str],
        rematerialised: Collection[str],
    ) -> None:
        global_hooks = nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
        self.plain = frozenset(  # an nn.Embedding run as it is: its backward reads no parameter
            name
            for name in lookups
            if not global_hooks and not (modules[name]._forward_hooks or modules[name]._forward_pre_hooks)
        )
        self.fetching = fetchable & self.plain
        self.rematerialised = rematerialised

    def fetches_rows(self, name: str, forced: Collection[str]) -> bool:
        """Whether this call of unit ``name`` fetches its rows (``forced``: the units a torch
        checkpoint region rematerialises now)."""
        return name in self.fetching and name not in forced and torch._C._functorch.maybe_current_level() is None

    def backward_reads(self, name: str, forced: Collection[str]) -> bool:
        """Whether the backward of this use of unit ``name`` may read its gathered parameters:
        not for a lookup run plainly (a rematerialised one runs again in backward; a transform
        may rewrite the lookup)."""
        return not (
            name in self.plain
            and name not in self.rematerialised
            and name not in forced
            and torch._C._functorch.maybe_current_level() is None
        )


class RowFetch:
    """One call of a lookup unit: its distinct indices, the other ranks' (what this rank serves
    them), and which run of its rows' elements each rank holds. Kept for the backward: these
    indices only (the element positions are recomputed, never stored)."""

    state = UnitState.SHARDED  # never gathered

    def __init__(self, unit: Unit, shard: torch.Tensor, group: dist.ProcessGroup, owner: Any) -> None:
        self.unit, self.shard, self.group, self.owner = unit, shard, group, owner
        self.comm = comm_of(group)  # pairwise: ``fetchable`` chose this unit for it
        self.world, self.rank = group.size(), group.rank()
        self.rows_in_table, self.dim = unit.params[0].shape
        self.distinct = torch.empty(0, dtype=torch.long)
        self.theirs: list[torch.Tensor | None] = []  # per rank: its distinct indices (None: this rank, or none)
        self.runs: list[tuple[int, int]] = []  # per rank: the [start, end) of my rows' flat elements it holds
        self.node = -1  # the sequence number of its lookup's autograd node

    def release(self) -> None:
        """Nothing gathered, nothing to drop (the rows go with autograd's graph)."""

    def _before(self, rows: torch.Tensor, position: int) -> int:
        """How many elements of ``rows`` (sorted, row-major; the table is the unit's only
        parameter, at offset 0 of the flat buffer) lie before flat ``position``."""
        return int((position - rows * self.dim).clamp(0, self.dim).sum())

    def _held(self, rows: torch.Tensor) -> torch.Tensor:
        """The shard positions of the elements of ``rows`` (sorted) this rank holds, in order."""
        n = self.shard.numel()
        start = self.rank * n
        first, stop = torch.searchsorted(rows, torch.tensor([start // self.dim, -(-(start + n) // self.dim)]))
        at = (rows[first:stop, None] * self.dim + torch.arange(self.dim)).view(-1) - start
        return at[(at >= 0) & (at < n)]

    def _served(self, j: int) -> int:
        """How many elements of rank ``j``'s rows this rank holds."""
        theirs, n = self.theirs[j], self.shard.numel()
        return 0 if theirs is None else self._before(theirs, (self.rank + 1) * n) - self._before(theirs, self.rank * n)

    def fetch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, inverse, distinct): the rows of the distinct indices (``distinct.numel()`` x D),
        and each index's position among them. Blocks until they arrived. Outside autograd (the
        shard is the step's leaf): ``RowLookup`` is the rows' only way back to it."""
        with torch.no_grad():
            return self._fetch(indices)

    def _fetch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        world, rank, n = self.world, self.rank, self.shard.numel()
        what = functools.partial(_guard.describe, "row_fetch", self.unit.name)
        distinct, inverse = torch.unique(indices.reshape(-1).long(), sorted=True, return_inverse=True)
        if distinct.numel():
            _check_range(int(distinct[0]), int(distinct[-1]), self.unit)
        record("row_fetch", self.unit.name, 0, self.shard.dtype, self.group)
        self.distinct = distinct
        counts = [None if j == rank else torch.empty(1, dtype=torch.long) for j in range(world)]
        count = torch.tensor([distinct.numel()])
        self.comm.exchange([None if j == rank else count for j in range(world)], counts, what).wait()
        self.theirs = [None if c is None or not int(c) else torch.empty(int(c), dtype=torch.long) for c in counts]
        sends = [None if j == rank or not distinct.numel() else distinct for j in range(world)]
        self.comm.exchange(sends, self.theirs, what).wait()
        self.runs = [(self._before(distinct, j * n), self._before(distinct, (j + 1) * n)) for j in range(world)]
        with label("gathered"):
            rows = torch.empty(distinct.numel() * self.dim, dtype=self.shard.dtype, device=self.shard.device)
        into = [None if j == rank or a == b else rows[a:b] for j, (a, b) in enumerate(self.runs)]
        answers = [
            None if t is None or not self._served(j) else self.shard[self._held(t)] for j, t in enumerate(self.theirs)
        ]
        self.comm.exchange(answers, into, what).wait()
        a, b = self.runs[rank]
        rows[a:b] = self.shard[self._held(distinct)]
        return rows.view(-1, self.dim), inverse.view(indices.shape), distinct

    def reduce(self, grad: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Send each element of the rows' gradient (distinct x D) to its holder without waiting;
        call the result to wait and get this rank's gradient shard (summed in rank order, / W)."""
        world, rank = self.world, self.rank
        what = functools.partial(_guard.describe, "row_reduce", self.unit.name)
        record("row_reduce", self.unit.name, 0, self.shard.dtype, self.group)
        flat = grad.detach().reshape(-1)
        sends = [None if j == rank or a == b else flat[a:b] for j, (a, b) in enumerate(self.runs)]
        served = [self._served(j) for j in range(world)]
        with label("comm"):
            got = [flat.new_empty(k) if k else None for k in served]
        pending = self.comm.exchange(sends, got, what)

        def finish() -> torch.Tensor:
            pending.wait()
            with torch._C._DisableFuncTorch(), torch.no_grad(), label("grads"):
                total = torch.zeros_like(self.shard)
                a, b = self.runs[rank]
                mine = flat[a:b]  # the elements of my own rows that I hold
                for j in range(world):
                    rows = self.distinct if j == rank else self.theirs[j]
                    values = mine if j == rank else got[j]
                    if rows is not None and values is not None and values.numel():
                        total[self._held(rows)] += values  # distinct positions: an exact sum, in rank order
                return total.mul_(1.0 / world)

        return finish


class RowLookup(torch.autograd.Function):
    """shard -> the fetched rows; backward: the rows' gradient goes to their holders (the owner's sink)."""

    @staticmethod
    def forward(shard: torch.Tensor, fetch: RowFetch, rows: torch.Tensor) -> torch.Tensor:
        return rows

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.fsdp_fn_use = inputs[1]  # type: ignore[attr-defined]
        if not torch._C._are_functorch_transforms_active():  # (a transform's node is not in the loss's graph)
            inputs[1].node = ctx._sequence_nr()  # type: ignore[attr-defined]  # how the graph walk knows it reaches this call
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor, None, None]:
        fetch: RowFetch = ctx.fsdp_fn_use
        if grad is None:
            grad = torch.zeros(fetch.distinct.numel(), fetch.dim, dtype=fetch.shard.dtype, device=fetch.shard.device)
        fetch.owner.after_row_backward(fetch, fetch.reduce(grad))
        shard = fetch.shard
        return torch.zeros((), dtype=shard.dtype, device=shard.device).expand(shard.shape), None, None


row_lookup = plain_apply(RowLookup)


def check_indices(indices: Any, unit: Unit, *, in_range: bool = False) -> None:
    """The lookup's input: an integer tensor (what ``F.embedding`` accepts); with ``in_range``,
    also its values (on the CPU only: elsewhere it would wait for the device)."""
    if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
        got = indices.dtype if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise TypeError(f"unit {unit_label(unit.name)} (nn.Embedding) takes int32 or int64 indices, got {got}")
    if in_range and indices.numel() and indices.device.type == "cpu":
        low, high = torch.aminmax(indices)
        _check_range(int(low), int(high), unit)


def _check_range(low: int, high: int, unit: Unit) -> None:
    rows = unit.params[0].shape[0] if unit.params else unit.frozen[0].shape[0]
    if not (low >= 0 and high < rows):
        raise IndexError(
            f"unit {unit_label(unit.name)} (nn.Embedding of {rows} rows) was given index {low if low < 0 else high}"
        )
