"""What a step will issue and hold, from the plan alone."""

from __future__ import annotations

import torch

from fsdp_fn import _reached as reached
from fsdp_fn._base import GradientTransformation, count_global_norms, count_max_norms
from fsdp_fn._collectives import Collective
from fsdp_fn._comm import Comm
from fsdp_fn._lookup import rows_fit
from fsdp_fn._plan import ROOT, Plan
from fsdp_fn._policy import Schedule
from fsdp_fn._prefetch import gathered_bytes, kept_tail
from fsdp_fn._tp_plan import (
    COLWISE,
    COLWISE_GATHER_OUTPUT,
    EMBEDDING_ROWWISE,
    REPLICATED_WITH_GRAD_ALLREDUCE,
    ROWWISE,
    ROWWISE_SPLIT_INPUT,
    VOCAB_PARALLEL,
)


def metrics_words(plan: Plan) -> int:
    """Float64 numbers each rank contributes to a step's one metrics all-gather: loss, squared
    gradient norm, two for the collective fingerprint, then which parameters got a gradient
    (48 bits per number)."""
    return 4 + reached.words(plan)


def predict_collectives(
    plan: Plan,
    world: int,
    schedule: Schedule | None = None,
    *,
    first_step: bool = True,
    replicas: int = 1,
    lookup_rows: bool | None = None,
    optimizer: GradientTransformation | None = None,
    comm: Comm | None = None,
    tokens: int | None = None,
) -> list[Collective]:
    """Predict what one train step issues on each rank, from the plan alone (units run in plan order).

    Per use of a unit (a shared tied parameter is used by each of its modules), per flat
    part (trainable, one frozen per dtype): one all-gather in forward in the gather dtype; one more in
    backward when the unit is resharded after forward (never the root; from the second
    step on, not the units that ran last and stay gathered for backward, see
    ``_prefetch.kept_tail``; not a ``lookup`` unit, whose backward reads no parameter). Per use, one
    reduce-scatter of the trainable part in the reduce dtype and, with ``replicas``
    (hybrid sharding), one all-reduce of the gradient shard across them. Then one
    all-gather of ``metrics_words(plan)`` float64 numbers per rank (the step's loss,
    gradient norm, the fingerprint of the collectives it issued and which parameters got
    a gradient), and with replicas an all-reduce of two numbers and one per parameter. With
    ``update_in_backward``, per unit one all-reduce of a number per parameter (which
    parameters any rank reached), over the ranks and over the replicas, before its update.

    Nothing is allocated, nothing is communicated.

    Args:
        plan: the plan the step shards by.
        world: the number of ranks sharing each unit (the shard group's size).
        schedule: the step's ``Schedule`` (``None``: the default one).
        first_step: predict the first step, where every resharded unit is gathered again
            for backward; ``False``: a later step, where the units that ran last stay
            gathered for backward.
        replicas: the replicate group's size with hybrid sharding (1: none).
        lookup_rows: a lookup unit's rows are fetched instead of its table gathered (the
            train step over a pairwise comm, gloo's default; ``None``: what ``comm`` says,
            ``Comm.pairwise``, or ``True`` without one): one ``row_fetch`` in forward and one
            ``row_reduce`` in backward (``numel`` 0: their size follows the indices), unless
            the table is small (``ROWS_MIN_BYTES``), the schedule casts or moves its shard,
            micro-batches are summed before reducing, or there are replicas.
        optimizer: the step's optimizer; then also what its update issues in a step that
            applies it (for ``accumulate``, the call that ends a round): one all-reduce of
            one float64 number per global norm it computes (``clip_by_global_norm``,
            ``apply_if_finite``), over the ranks and over the replicas; of ``W`` numbers over
            the ranks only per max-norm (``clip_by_global_norm(norm_type=math.inf)``).
        comm: the step's group's comm (``comm_of(layout.group)``), asked whether lookups
            fetch rows when ``lookup_rows`` is ``None`` (``False`` on NCCL, on
            ``FSDP_FN_COLLECTIVES=native``, or on a comm of the user's that is not pairwise).
        tokens: under tensor parallelism (``plan.tensor``), the rows (batch x sequence) each
            split module runs on in one forward: then also the axis's collectives of the
            activations, named by module (``tensor_parallel_collectives``). The step's norm is
            summed over the axis too (one all-reduce of a number, and one per global norm
            the optimizer computes).

    Returns:
        The ``Collective``s, unit by unit in plan order (not interleaved as the step
        issues them), then the step's own; none over a group of one rank (it communicates
        nothing). Compare with a ``comm_log()``'s records as a multiset.
    """
    schedule = schedule or Schedule()
    if lookup_rows is None:
        lookup_rows = comm.pairwise if comm is not None else True
    nbytes = gathered_bytes(plan, world, schedule)
    order = [u.name for u in plan.units if u.name != ROOT]
    kept = set(order[kept_tail(order, nbytes, schedule) :])
    out: list[Collective] = []
    for u in plan.units:
        # update_in_backward: which of the unit's parameters any rank reached, before its update
        merged = [Collective("all_reduce", u.name, len(u.params), torch.float32, n) for n in (world, replicas)]
        merged = merged if u.params and schedule.update_in_backward else []
        if lookup_rows and rows_fit(u, schedule, replicas, world):
            out += [
                Collective("row_fetch", u.name, 0, u.dtype, world),
                Collective("row_reduce", u.name, 0, u.dtype, world),
                *merged,
            ]
            continue
        resharded = (
            schedule.reshard_after_forward and u.name != ROOT and not u.lookup and (first_step or u.name not in kept)
        )
        parts = [p for p in (u, *u.frozen_parts) if p.params]
        for _ in u.hooks or (u.name,):  # a shared unit is gathered by each of its modules, a group once
            for part in parts:
                n, gather = part.padded_numel(world), schedule.gather_dtype(part.dtype)
                out += [Collective("all_gather", u.name, n, gather, world)] * (1 + resharded)
            if u.params:
                reduce = schedule.reduce_dtype(u.dtype)
                out.append(Collective("reduce_scatter", u.name, u.padded_numel(world), reduce, world))
                if replicas > 1:
                    out.append(Collective("all_reduce", u.name, u.shard_numel(world), reduce, replicas))
        out += merged
    out.append(Collective("all_gather", None, metrics_words(plan) * world, torch.float64, world))
    tp = plan.tensor.size if plan.tensor is not None else 1
    out.append(Collective("all_reduce", None, 1, torch.float64, tp))  # the norm, over the tensor axis
    if tokens is not None:
        out += tensor_parallel_collectives(plan, tokens, schedule)
    if replicas > 1:
        reached = sum(len(u.params) for u in plan.units)  # which parameters any replica reached
        out.append(Collective("all_reduce", None, 2 + reached, torch.float64, replicas))
    for _ in range(count_global_norms(optimizer) if optimizer is not None else 0):
        out += [Collective("all_reduce", None, 1, torch.float64, n) for n in (world, tp, replicas)]
    for _ in range(count_max_norms(optimizer) if optimizer is not None else 0):
        out.append(Collective("all_reduce", None, world, torch.float64, world))  # each rank's maximum at its index
    return [c for c in out if c.world > 1]


def tensor_parallel_collectives(plan: Plan, tokens: int, schedule: Schedule | None = None) -> list[Collective]:
    """What the split modules of a tensor-parallel plan issue over its axis in one forward and
    backward, each module run once on ``tokens`` rows (without rematerialisation, whose
    recomputation issues the forward's again): a column-split module's input gradient summed in
    backward, a row-split module's (and a split embedding's) output summed in forward, a
    gathered output gathered in forward (padded to ``torch.chunk``'s pieces). In the gathered
    dtype. Nothing is allocated, nothing is communicated.

    Args:
        plan: a plan with ``tensor`` set (an empty list without).
        tokens: the rows each split module runs on.
        schedule: the step's ``Schedule`` (its mixed precision's gathered dtype).

    Returns:
        The ``Collective``s, named by module path, over the tensor-parallel axis.

    Raises:
        ValueError: under sequence parallelism (``plan.tensor.sequence_parallel``).
    """
    tensor, schedule = plan.tensor, schedule or Schedule()
    if tensor is None or tensor.size == 1:
        return []
    if tensor.sequence_parallel:
        raise ValueError(
            "predict_collectives(tokens=...) does not predict sequence parallelism's collectives (their sizes "
            "follow the sequence's pieces and the layers' widths, which the plan does not hold); leave tokens out "
            "to predict the rest"
        )
    out: list[Collective] = []
    for spec in plan.params:
        path, _, attr = spec.name.rpartition(".")
        style, dtype, n = tensor.style_of(path), schedule.gather_dtype(spec.dtype), tensor.size
        if style == REPLICATED_WITH_GRAD_ALLREDUCE and spec.requires_grad:  # each parameter's gradient summed
            out.append(Collective("all_reduce", path, spec.numel, dtype, n))
        if spec.split is None or attr != "weight":
            continue
        if style in (COLWISE, COLWISE_GATHER_OUTPUT, VOCAB_PARALLEL):
            out.append(Collective("all_reduce", path, tokens * spec.shape[1], dtype, n))  # the input's gradient
        if style == COLWISE_GATHER_OUTPUT:
            out.append(Collective("all_gather", path, tokens * -(-spec.split[1] // n) * n, dtype, n))
        if style == ROWWISE_SPLIT_INPUT:  # the input's piece taken: its gradient gathered in backward
            out.append(Collective("all_gather", path, tokens * -(-spec.split[1] // n) * n, dtype, n))
        if style in (ROWWISE, ROWWISE_SPLIT_INPUT):
            out.append(Collective("all_reduce", path, tokens * spec.shape[0], dtype, n))
        if style == EMBEDDING_ROWWISE:
            out.append(Collective("all_reduce", path, tokens * spec.shape[1], dtype, n))
    return out
