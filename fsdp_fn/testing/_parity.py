"""Parity with the unsharded model: ``assert_matches_unsharded`` and the ``Divergence`` it raises."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as torch_pytree
from torch import nn

from fsdp_fn._base import GradientTransformation
from fsdp_fn._plan import Plan, Policy, make_plan, unit_label

# step(fn, loss_fn, params, state, batch) -> (loss, params, state): a train step of the user's own
CustomStep = Callable[[Any, Callable[..., Any], Any, Any, Any], tuple[torch.Tensor, Any, Any]]

_ALONE: dict[int, tuple[Any, dist.ProcessGroup]] = {}  # id(default group) -> (it, this rank's group of one)


def alone() -> dist.ProcessGroup:
    """A process group of this rank alone, made once per default group by this rank only
    (``use_local_synchronization``: the other ranks need not call it); what a reference run
    of fsdp_fn's own code on the unsharded parameters shards over. No communication."""
    default = dist.distributed_c10d._get_default_group()
    kept = _ALONE.get(id(default))
    if kept is None or kept[0] is not default:
        group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        assert isinstance(group, dist.ProcessGroup)
        kept = _ALONE[id(default)] = (default, group)
    return kept[1]


class Divergence(AssertionError):
    """The sharded run and the unsharded reference differ; ``where`` names the first place.

    An ``AssertionError``, so a test framework reports it as a failed assertion.

    Args:
        message: the step, unit and parameter, the largest difference and where it is.
        where: the same place as values (see the attribute).

    Attributes:
        where: holds ``step`` (0-based), ``what`` (``"loss"``, ``"gradient"`` or
            ``"parameter"``), ``unit`` and ``parameter`` (``None`` for the loss) and
            ``error`` (the largest absolute difference).
    """

    def __init__(self, message: str, where: dict[str, Any]) -> None:
        super().__init__(message)
        self.where = where


def split_batch(batch: Any, rank: int, world: int) -> Any:
    """This rank's equal part (along dim 0) of every tensor in ``batch``.

    The parts are views of the batch's tensors: no copy, no communication.

    Args:
        batch: a pytree (``torch.utils._pytree``) of the global batch; leaves that are not
            tensors are kept as they are.
        rank: this rank's place among the ``world`` data-parallel ranks.
        world: how many ranks the batch is split over.

    Returns:
        The batch in the same structure, each tensor replaced by its ``rank``-th part.

    Raises:
        ValueError: if a tensor's first dimension does not divide by ``world``.
    """

    def part(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.shape[0] % world:
            raise ValueError(f"a global batch of {t.shape[0]} does not split evenly over {world} ranks")
        return t.chunk(world)[rank]

    return torch_pytree.tree_map(part, batch)


def assert_matches_unsharded(
    module: nn.Module,
    loss_fn: Callable[[Callable[..., Any], Any], torch.Tensor],
    batches: Sequence[Any],
    *,
    group: Any = None,
    policy: Policy | None = None,
    plan: Plan | None = None,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | GradientTransformation | None = None,
    step: CustomStep | None = None,
    split: Callable[[Any, int, int], Any] = split_batch,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **step_options: Any,
) -> dict[str, float]:
    """Run ``module`` sharded over ``group`` and unsharded here; raise ``Divergence`` at the first difference.

    Call it on every rank. Each step takes one global batch from ``batches``; the sharded
    run gives each rank ``split(batch, rank, world)`` and averages over ranks, the
    reference runs the whole batch in this process. What runs:

    - ``optimizer`` a factory (tensors -> ``torch.optim.Optimizer``): ``train_step`` with
      ``from_torch(optimizer(shards))`` against ``optimizer(params)`` on a copy of the
      module.
    - ``optimizer`` a ``GradientTransformation`` (``ff.chain(ff.clip_by_global_norm(1.0),
      ff.adamw())``, one of your own): ``train_step`` with it (in place, on the shards)
      against the same transformation's functional ``update`` + ``apply_updates`` on one
      process: the copy's gradients from torch's ``backward``, its parameters sharded over
      a group of this rank alone.
    - ``step`` (a train step of your own: second-order code, several gradients a step):
      ``step(fn, loss_fn, params, state, batch) -> (loss, params, state)``, ``state``
      ``None`` at the first call, run on the sharded parameters and this rank's part, and
      again as the reference on the copy's parameters sharded over a group of this rank
      alone, with the whole batch: a step that gives other numbers sharded is caught.
    - neither: it differentiates with ``value_and_grad`` (the train step's gradient
      function): the loss and every gradient at the initial parameters, per batch.

    Training compares the loss, then every parameter after each step. ``step_options`` go
    to ``train_step``. Compares in plan order, with ``|sharded - reference| <= atol + rtol *
    |reference|`` (the train step reports its loss in float32, so training compares the
    loss to at least float32's epsilon); returns the largest absolute difference seen for
    the loss, the gradients and the parameters. Memory: the whole model twice on every
    rank (the reference and the unsharded result); communication: the run's own, plus one
    all-gather per unit per comparison.

    Args:
        module: the model; the reference is a copy of it.
        loss_fn: ``loss_fn(model, batch) -> loss``, called with the sharded model's
            function and this rank's part of the batch, and with the reference module (or,
            for a ``step``, its function) and the whole batch.
        batches: one global batch per step (the same on every rank).
        group: the ranks to shard over: a ``ProcessGroup``, a mesh, or ``None`` (the
            default group), as ``shard`` takes it.
        policy: the unit policy for ``make_plan`` when ``plan`` is not given.
        plan: the plan to shard by; ``None``: ``make_plan(module, policy)``.
        optimizer: a factory, tensors -> ``torch.optim.Optimizer``, or a
            ``GradientTransformation``; ``None`` compares gradients instead of training
            (or runs ``step``).
        step: a train step of your own, ``step(fn, loss_fn, params, state, batch) -> (loss,
            params, state)`` (``fn`` the model's function, ``params`` ``Sharded``, ``loss``
            the mean over ``batch``); not with ``optimizer``.
        split: ``split(batch, rank, world)``: this rank's part of a global batch.
        rtol: relative tolerance.
        atol: absolute tolerance.
        **step_options: passed on to ``train_step`` (only with ``optimizer``).

    Returns:
        The largest absolute difference seen, by kind, in a dict keyed ``"loss"``,
        ``"gradient"`` and ``"parameter"``.

    Raises:
        Divergence: at the first difference beyond the tolerance, naming the step, the
            unit and the parameter.
        ValueError: if ``step_options`` are given without an ``optimizer``, or both
            ``optimizer`` and ``step``.
    """
    from fsdp_fn._base import apply_updates
    from fsdp_fn._collectives import all_gather, all_reduce_over_
    from fsdp_fn._functional import functionalize
    from fsdp_fn._grad import value_and_grad
    from fsdp_fn._optim import from_torch
    from fsdp_fn._shard import reduce_grads, shard, unshard
    from fsdp_fn._step import train_step

    if optimizer is not None and step is not None:
        raise ValueError("assert_matches_unsharded takes an optimizer or a step of your own, not both")
    if step_options and optimizer is None:
        raise ValueError(
            f"train_step options {sorted(step_options)} need an optimizer: without one nothing trains "
            "(a step of your own takes its options itself)"
        )
    plan = plan if plan is not None else make_plan(module, policy)
    fn = functionalize(module)
    params = shard(fn.params, plan, group)
    pg = params.group
    # Data parallel over every rank: with replicas (hybrid sharding), over the whole mesh.
    world = params.layout.world * params.layout.replicas
    rank = pg.rank() if not params.layout.replica_axes else dist.get_rank()
    reference = copy.deepcopy(module)
    trainable = {k: p for k, p in reference.named_parameters() if p.requires_grad}
    worst = {"loss": 0.0, "gradient": 0.0, "parameter": 0.0}

    def mean_over_ranks(x: torch.Tensor) -> float:
        every = all_gather(x.detach().double().reshape(1), pg)
        if params.layout.replicas > 1:
            every = all_reduce_over_(every, params.layout.replica_groups) / params.layout.replicas
        return float(every.mean())

    def compare(
        step: int, what: str, name: str | None, got: torch.Tensor, want: torch.Tensor, rel: float = rtol
    ) -> None:
        got, want = got.detach().double(), want.detach().double()
        diff = (got - want).abs()
        error = float(diff.max()) if diff.numel() else 0.0
        worst[what] = max(worst[what], error)
        if not bool((diff > atol + rel * want.abs()).any()):
            return
        unit = plan.unit_of(name).name if name is not None else None
        at = f"the {what} of unit {unit_label(unit)}, parameter {name!r}," if unit is not None else "the loss"
        index = tuple(int(i) for i in torch.nonzero(diff == error)[0])
        raise Divergence(
            f"step {step}: {at} differs from the unsharded model's by {error:.3g} (largest at index {index}: "
            f"sharded {float(got[index]):.8g}, unsharded {float(want[index]):.8g}; atol={atol}, rtol={rel})",
            {"step": step, "what": what, "unit": unit, "parameter": name, "error": error},
        )

    def compare_params(i: int, got: Any, want: Any) -> None:
        full_got, full_want = unshard(got), unshard(want)
        for spec in plan.params:
            compare(i, "parameter", spec.name, full_got[spec.name], full_want[spec.name])

    if step is not None:
        ref_fn = functionalize(reference)
        ref_params = shard(ref_fn.params, plan, alone())
        ours: Any = None
        theirs: Any = None
        for i, batch in enumerate(batches):
            loss, params, ours = step(fn, loss_fn, params, ours, split(batch, rank, world))
            want, ref_params, theirs = step(ref_fn, loss_fn, ref_params, theirs, batch)
            compare(i, "loss", None, torch.tensor(mean_over_ranks(loss), dtype=torch.float64), want)
            compare_params(i, params, ref_params)
        return worst

    if optimizer is None:
        for i, batch in enumerate(batches):
            loss, grads = value_and_grad(fn, loss_fn)(params, fn.buffers, split(batch, rank, world))
            reference.zero_grad()
            want = loss_fn(reference, batch)
            want.backward()
            compare(i, "loss", None, torch.tensor(mean_over_ranks(loss), dtype=torch.float64), want)
            full = unshard(grads, frozen=False)
            for spec in plan.params:
                if spec.name in trainable:
                    ref_grad = trainable[spec.name].grad
                    compare(
                        i,
                        "gradient",
                        spec.name,
                        full[spec.name],
                        torch.zeros(spec.shape) if ref_grad is None else ref_grad,
                    )
        return worst

    if isinstance(optimizer, GradientTransformation):
        ref_params = shard(functionalize(reference).params, plan, alone())
        ref_state = optimizer.init(ref_params)
        step_fn = train_step(fn, loss_fn, optimizer, **step_options)
        state = step_fn.init(params)
        for i, batch in enumerate(batches):
            state, metrics = step_fn(state, split(batch, rank, world))
            reference.zero_grad(set_to_none=True)
            want = loss_fn(reference, batch)
            want.backward()
            got = {k: p.grad for k, p in trainable.items() if p.grad is not None}
            updates, ref_state = optimizer.update(reduce_grads(got, ref_params), ref_state, ref_params)
            ref_params = apply_updates(ref_params, updates)
            with torch.no_grad():  # the copy's next forward runs at the updated parameters
                new = unshard(ref_params)
                for k, p in trainable.items():
                    p.copy_(new[k])
            compare(i, "loss", None, metrics["loss"], want, max(rtol, torch.finfo(torch.float32).eps))
            compare_params(i, state.params, ref_params)
        return worst

    assert optimizer is not None
    state_opt = optimizer(list(trainable.values()))
    step_fn = train_step(fn, loss_fn, from_torch(optimizer(list(params.values()))), **step_options)
    state = step_fn.init(params)
    for i, batch in enumerate(batches):
        state, metrics = step_fn(state, split(batch, rank, world))
        state_opt.zero_grad()
        want = loss_fn(reference, batch)
        want.backward()
        state_opt.step()
        # The step reports its loss in float32.
        compare(i, "loss", None, metrics["loss"], want, max(rtol, torch.finfo(torch.float32).eps))
        full = unshard(state.params)
        for spec in plan.params:
            compare(i, "parameter", spec.name, full[spec.name], dict(reference.named_parameters())[spec.name])
    return worst
