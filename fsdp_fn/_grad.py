"""Gradients as values: ``value_and_grad`` over shards, and the lean pass the train step runs.

The lean pass differentiates the loss with ``torch.func.vjp`` over the shards; the
gathers on the way are the lean ones of ``_gather.py``, whose backward hands each unit's
full gradient to a ``GradSink`` instead of returning it through autograd. The sink
issues the unit's reduce-scatter at once and waits for it only behind the next unit's
backward, so communication overlaps the rest of backward; when backward is done the
sink holds one gradient shard per unit that the loss reached, and which of each unit's
parameters it reached. (vjp's own result is then zeros that own no memory.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch.func import grad_and_value, vjp

from fsdp_fn._collectives import all_reduce_
from fsdp_fn._functional import Functional
from fsdp_fn._gather import GradSink, Runtime
from fsdp_fn._guard import guarded
from fsdp_fn._plan import Policy
from fsdp_fn._policy import Schedule
from fsdp_fn._remat import Remat
from fsdp_fn._shard import Sharded, ensure_live

LossFn = Callable[[Callable[..., Any], Any], torch.Tensor]


def checked_loss(loss: Any) -> torch.Tensor:
    """``loss`` as a 0-d tensor, or a clear error when it cannot be differentiated."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        got = f"shape {tuple(loss.shape)} {loss.dtype}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"loss_fn must return a floating scalar tensor, got {got}")
    if not loss.requires_grad:
        raise ValueError(
            "loss_fn returned a loss that does not require grad: it is detached from the parameters "
            "(.detach(), torch.no_grad(), or computed from no unit's output), so no parameter would get a "
            "gradient; nothing was applied"
        )
    return loss.reshape(())


def lean_pass(
    runtime: Runtime, params: Sharded, buffers: Mapping[str, torch.Tensor], batch: Any, loss_fn: LossFn
) -> torch.Tensor:
    """Forward and backward of ``loss_fn`` on this rank's ``batch``; return the loss (detached).

    The gradients end in ``runtime.sink``. Memory: shards, the units in flight, the
    activations, one full unit gradient per reduce-scatter in flight.
    """

    def objective(shards: dict[str, torch.Tensor]) -> torch.Tensor:
        model = functools.partial(runtime.run_on, params.replace(shards), buffers)
        loss = checked_loss(loss_fn(model, batch))
        runtime.finish_forward(loss)
        return loss

    # vjp rather than grad: grad always differentiates with create_graph=True, which keeps
    # every backward intermediate alive for a second derivative nobody asked for.
    loss, vjp_fn = vjp(objective, params.shards)  # type: ignore[misc]
    vjp_fn(torch.ones_like(loss), retain_graph=False, create_graph=False)
    runtime.sink.drain()  # the reduce-scatters still in flight, before anything reads a gradient
    runtime.release_all()
    return cast(torch.Tensor, loss.detach())


def _inside_transform() -> bool:
    return torch._C._functorch.maybe_current_level() is not None


def value_and_grad(
    fn: Functional,
    loss_fn: LossFn,
    *,
    schedule: Schedule | None = None,
    remat: bool | Policy | Remat | None = None,
    timeout: float = 300.0,
) -> Callable[[Sharded, Mapping[str, torch.Tensor], Any], tuple[torch.Tensor, Sharded]]:
    """``value_and_grad(fn, loss_fn)(params, buffers, batch) -> (loss, grads)`` over shards.

    ``loss_fn(model, batch)`` calls ``model`` with whatever the module's forward takes.
    ``loss`` is this rank's loss; ``grads`` is ``Sharded`` like ``params``: the gradient of
    the mean over ranks of their losses (averaged across replicas with a hybrid mesh),
    with ``grads.received`` marking which parameters the loss reached (the others are
    zero, and optimizers skip them as torch.optim skips a ``None`` ``.grad``).

    Called plainly it runs the train step's lean pass: each unit is gathered just before
    it runs, freed after, gathered again for its backward, and its reduce-scatter runs
    behind the next unit's backward. Called inside another ``torch.func`` transform
    (``jvp`` of it for a Hessian-vector product, ``vmap``, ``grad``) it runs the composable
    path instead, so the outer transform sees through every collective. Communication: per
    unit use an all-gather in forward and backward and a reduce-scatter; one all-reduce of
    one byte per parameter (which parameters got a gradient, on any rank).
    """
    schedule = schedule or Schedule()
    rematerialise = Remat.of(remat)

    def run(params: Sharded, buffers: Mapping[str, torch.Tensor], batch: Any) -> tuple[torch.Tensor, Sharded]:
        ensure_live(params, "value_and_grad")
        if _inside_transform():
            return _composable(fn, loss_fn, schedule, rematerialise, params, buffers, batch)
        sink = GradSink(params, schedule)
        runtime = Runtime(fn, params, schedule=schedule, sink=sink, remat=rematerialise)
        with guarded(params.group, "value_and_grad", timeout):
            loss = lean_pass(runtime, params, buffers, batch, loss_fn)
            masks = _all_ranks(sink.received_masks(), params)
        plan = params.plan
        grads = {u.name: sink.totals.get(u.name) for u in plan.units}
        shards = {u: g if g is not None else torch.zeros_like(params[u]) for u, g in grads.items()}
        return loss, params.replace(shards).with_received(masks)

    return run


def _all_ranks(masks: Mapping[str, tuple[bool, ...]], params: Sharded) -> dict[str, tuple[bool, ...]]:
    """A parameter got a gradient if it did on any rank (the global batch reached it)."""
    plan, layout = params.plan, params.layout
    flat = torch.tensor(
        [float(bit) for u in plan.units for bit in masks.get(u.name, (False,) * len(u.params))], dtype=torch.float32
    )
    if flat.numel() and layout.world > 1:
        all_reduce_(flat, layout.group)
    out, at = {}, 0
    for u in plan.units:
        out[u.name] = tuple(bool(b > 0) for b in flat[at : at + len(u.params)])
        at += len(u.params)
    return out


def _composable(
    fn: Functional,
    loss_fn: LossFn,
    schedule: Schedule,
    remat: Remat | None,
    params: Sharded,
    buffers: Mapping[str, torch.Tensor],
    batch: Any,
) -> tuple[torch.Tensor, Sharded]:
    def objective(shards: dict[str, torch.Tensor]) -> torch.Tensor:
        runtime = Runtime(fn, params.replace(shards), schedule=schedule, composable=True, remat=remat)
        return checked_loss(loss_fn(functools.partial(runtime.run, buffers), batch))

    grads, loss = grad_and_value(objective)(params.shards)
    return loss, params.replace(grads)
