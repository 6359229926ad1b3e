"""Gradients as values: ``value_and_grad`` over shards, and the one pass it and the train step run.

``sharded_pass`` is that pass: the micro-batch loop, forward prefetch along the last call's
order, compiled units, the checks of a checked call, the frozen parameters dropped, the
mean over micro-batches. Each micro-batch's ``lean_pass`` differentiates the loss with
plain autograd over the shards; the gathers on the way are the lean runtime's
(``_lean.py``), whose backward hands each unit's full gradient to a ``GradSink``
(``_sink.py``) instead of returning it through autograd. The sink
issues the unit's reduce-scatter at once and waits for it only behind the next unit's
backward, so communication overlaps the rest of backward; when backward is done the
sink holds one gradient shard per unit that the loss reached, and which of each unit's
parameters it reached. (Autograd's own result is then zeros that own no memory.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.autograd.forward_ad as fwAD
import torch.utils._pytree as torch_pytree
from torch.func import grad_and_value

from fsdp_fn import _reached as reached
from fsdp_fn._base import drop_frozen
from fsdp_fn._composable import ComposableRuntime
from fsdp_fn._errors import DivergenceError, RankFailure
from fsdp_fn._functional import Functional, index_of
from fsdp_fn._guard import guarded
from fsdp_fn._lean import LeanRuntime
from fsdp_fn._phases import phase
from fsdp_fn._plan import Plan, Policy
from fsdp_fn._policy import Schedule
from fsdp_fn._remat import Remat
from fsdp_fn._runtime import model_handle
from fsdp_fn._shard import Sharded, ensure_live
from fsdp_fn._sink import GradSink
from fsdp_fn._standin import module_parameters_hidden

LossFn = Callable[[Callable[..., Any], Any], torch.Tensor]
CheckSchedule = Literal["first", "always", "never"]


def compile_options(compile: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """``compile=`` as ``torch.compile``'s options for every non-root unit (``None``: off)."""
    if not isinstance(compile, bool | Mapping):
        raise TypeError(f"compile must be True, False or torch.compile's options as a dict, got {compile!r}")
    return dict(compile) if isinstance(compile, Mapping) else ({} if compile else None)


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


def split_aux(out: Any, has_aux: bool) -> tuple[Any, Any]:
    """``loss_fn``'s result as ``(loss, aux)``; with ``has_aux`` it must be that pair."""
    if not has_aux:
        return out, None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"has_aux=True: loss_fn must return a pair (loss, aux), got {type(out).__name__}")
    return out


def micro_batches(schedule: Schedule, batch: Any) -> Sequence[Any]:
    """``batch`` as the list of micro-batches ``schedule`` asks for (one batch: ``[batch]``);
    a clear error when it is not that many."""
    n = schedule.micro_batches
    if n == 1:
        return [batch]
    if isinstance(batch, tuple):  # (x, y) is one batch to a loss that unpacks it, not two micro-batches
        raise ValueError(
            f"with Schedule(micro_batches={n}) the batch must be a list of {n} micro-batches, got a tuple of "
            f"{len(batch)}: a tuple is read as one batch (x, y), so its items are not split into micro-batches; "
            "pass [micro_batch_1, ...]"
        )
    if not isinstance(batch, Sequence) or len(batch) != n:
        got = f"{len(batch)} items" if isinstance(batch, Sequence) else type(batch).__name__
        raise ValueError(
            f"with Schedule(micro_batches={n}) the batch must be a list of that many micro-batches, got {got}"
        )
    return batch


def _detached(aux: Any) -> Any:
    return torch_pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux)


def lean_pass(
    runtime: LeanRuntime,
    params: Sharded,
    buffers: Mapping[str, torch.Tensor],
    batch: Any,
    loss_fn: LossFn,
    has_aux: bool = False,
) -> tuple[torch.Tensor, Any]:
    """Forward and backward of ``loss_fn`` on this rank's ``batch``; return the loss and the
    aux (``has_aux``; else None), detached.

    The gradients end in ``runtime.sink``. Memory: shards, the units in flight, the
    activations, one full unit gradient per reduce-scatter in flight.
    """

    aux: Any = None

    def objective(shards: dict[str, torch.Tensor]) -> torch.Tensor:
        nonlocal aux
        model = model_handle(runtime, functools.partial(runtime.run_on, params.replace(shards), buffers))
        with module_parameters_hidden(runtime.fn.module):
            out, aux = split_aux(loss_fn(model, batch), has_aux)
            loss = checked_loss(out)
        runtime.finish_forward(loss)
        return loss

    # Plain autograd, not torch.func.vjp: nothing outside differentiates through the lean
    # pass (its gradients leave through the sink), and without functorch's wrappers every
    # autograd.Function on the way (a parameter view each) takes autograd's C++ path; a
    # step is ~4% faster at W=1 (docs/performance.md). The loss_fn may still use torch.func.
    leaves = [t.detach().requires_grad_() for t in params.shards.values()]
    # The module's own parameters, which a loss may still reach through a reference taken
    # before the step (module_parameters_hidden catches the reads during it): asked for too,
    # so that such a gradient is noticed instead of dropped.
    originals = dict(_named_trainable(runtime.fn.module))
    try:
        with torch.enable_grad():
            loss = objective(dict(zip(params.shards, leaves, strict=True)))
        # autograd.grad, not backward: the shards' own results (zeros that own no memory) are dropped.
        reached = torch.autograd.grad(loss, [*leaves, *originals.values()], allow_unused=True)[len(leaves) :]
    except Exception as e:  # (not an interrupt: that should not wait on the exchanges in flight)
        if "backward through the graph a second time" in str(e):
            e.add_note(
                "fsdp_fn: did loss_fn call .backward() on its loss? The step differentiates the loss loss_fn "
                "returns; return it without a backward (one inside the loss for another purpose needs "
                "retain_graph=True)"
            )
        if not isinstance(e, RankFailure | DivergenceError):  # then the group is unusable: nothing to wait for
            runtime.abandon()
        raise
    runtime.finalize_backward()  # the reduce-scatters still in flight, before anything reads a gradient
    lost = [name for name, g in zip(originals, reached, strict=True) if g is not None]
    if lost:
        raise RuntimeError(
            f"loss_fn's loss depends on parameter {lost[0]!r} of the module itself"
            + (f" (and {len(lost) - 1} more)" if len(lost) > 1 else "")
            + ", through a reference taken outside model(...): the module keeps its original values, not the "
            "trained shards, and its gradient would be lost. Reach the model only through "
            "model(...), loss_fn's first argument"
        )
    return loss.detach(), _detached(aux)


def _named_trainable(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p) for name, p in index_of(module).named_parameters() if p.requires_grad]


def _differentiated_outside(params: Sharded) -> bool:
    """Whether something outside differentiates through this call: a ``torch.func``
    transform, plain autograd (shards that require grad), or forward-mode AD (a tangent).
    Then the composable path runs, so the outer derivative sees through every collective."""
    if torch._C._functorch.maybe_current_level() is not None:
        return True
    shards = [t for t in params.values() if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in shards):
        return True
    return any(fwAD.unpack_dual(t).tangent is not None for t in shards)


def value_and_grad(
    fn: Functional,
    loss_fn: LossFn,
    *,
    schedule: Schedule | None = None,
    remat: bool | Policy | Remat | None = None,
    timeout: float = 300.0,
    has_aux: bool = False,
    compile: bool | Mapping[str, Any] = False,
    check_schedule: CheckSchedule = "first",
) -> Callable[[Sharded, Mapping[str, torch.Tensor], Any], tuple[Any, Sharded]]:
    """Make ``value_and_grad(fn, loss_fn)(params, buffers, batch) -> (loss, grads)`` over shards.

    ``loss`` is this rank's loss; ``grads`` is ``Sharded`` like ``params``: the gradient of
    the mean over ranks of their losses (averaged across replicas with a hybrid mesh),
    with ``grads.received`` marking which parameters the loss reached (the others are
    zero, and optimizers skip them as torch.optim skips a ``None`` ``.grad``).

    Called plainly it runs the pass ``train_step`` runs (``sharded_pass``): each unit is
    gathered just before it runs (prefetched along the last call's order), freed after,
    gathered again for its backward, and its reduce-scatter runs behind the next unit's
    backward; compiled units run their compiled code. Called where something differentiates through it
    (inside another ``torch.func`` transform: ``jvp`` of it for a Hessian-vector product,
    ``vmap``, ``grad``; or on shards that require grad or carry a forward-mode tangent) it
    runs the composable path instead, so the outer derivative sees through every collective.
    Communication: per unit use an all-gather in forward and backward and a reduce-scatter;
    one all-reduce of one number per parameter (which parameters got a gradient, on any rank).

    Args:
        fn: the model, from ``functionalize(module)``.
        loss_fn: ``loss_fn(model, batch) -> loss``: calls ``model`` with whatever the
            module's forward takes and returns a floating scalar tensor (with ``has_aux``,
            the pair ``(loss, aux)``).
        schedule: the train step's ``Schedule`` (``None``: the default one); with
            ``micro_batches=N`` the batch is a list of N, run one after the other, and the
            loss and gradient are their means (``aux``: a list).
        remat: what ``train_step(remat=...)`` takes: ``None``/``False`` (no remat),
            ``True`` (every non-root unit), a unit policy, or a ``Remat``.
        timeout: seconds a rank waits on the others in a collective before it raises
            ``RankFailure`` (the lean pass's guard).
        has_aux: ``loss_fn`` returns ``(loss, aux)`` and the result is
            ``((loss, aux), grads)``, as in JAX; ``aux`` (any pytree: predictions, a metric)
            is this rank's, not differentiated (inside an outer transform it carries that
            transform's derivative, as ``torch.func.grad``'s aux does).
        compile: what ``train_step(compile=...)`` takes: ``True`` (or ``torch.compile``'s
            options as a dict) runs every non-root unit's module compiled that way.
        check_schedule: ``"first"`` (check the first call), ``"always"`` or ``"never"``:
            on checked calls ranks agree before every collective, as a train step's.

    Returns:
        ``run(params, buffers, batch) -> (loss, grads)`` (``((loss, aux), grads)`` with
        ``has_aux``), to be called on every rank of the shards' group with this rank's
        batch and the module's buffers (``fn.buffers``).

    Raises:
        TypeError: if ``remat`` is not one of the accepted kinds or ``compile`` neither a
            bool nor a dict; from ``run``, if ``loss_fn`` does not return a floating scalar
            tensor (with ``has_aux``, a pair).
        ValueError: if ``check_schedule`` is not one of its values; from ``run``: the loss
            does not require grad (detached from the parameters), the batch is not a list
            of ``micro_batches`` micro-batches, a parameter the plan holds frozen is
            trainable now, or the shards were made for another plan or world size.
        RuntimeError: from ``run``: ``params`` was donated to a train step (or left
            half-updated by a failed one), or the loss reaches a parameter of the module
            itself through a reference taken outside ``model(...)``.
        RankFailure: from ``run``: another rank failed or went silent for ``timeout``.
        DivergenceError: from ``run``: the ranks disagree on what they run.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from fsdp_fn import functionalize, make_plan, shard
        >>> m = nn.Linear(3, 1)
        >>> fn = functionalize(m)
        >>> params = shard(fn.params, make_plan(m))
        >>> grad_fn = value_and_grad(fn, lambda model, x: model(x).square().mean())
        >>> loss, grads = grad_fn(params, fn.buffers, torch.ones(2, 3))
        >>> grads[""].shape, grads.received[""]  # one unit: weight (3) and bias (1), both reached
        (torch.Size([4]), (True, True))
    """
    schedule = schedule or Schedule()
    rematerialise = Remat.of(remat)
    compiled = compile_options(compile)
    if check_schedule not in ("first", "always", "never"):
        raise ValueError(f"check_schedule must be 'first', 'always' or 'never', got {check_schedule!r}")
    memo = PassMemo()  # the order the last call ran the units in: forward prefetch follows it
    checks = {"next": check_schedule != "never"}

    def run(params: Sharded, buffers: Mapping[str, torch.Tensor], batch: Any) -> tuple[Any, Sharded]:
        ensure_live(params, "value_and_grad")
        frozen = params.plan.check_trainable(fn.module)  # since the plan: reach no gradient
        micro = micro_batches(schedule, batch)
        if _differentiated_outside(params):
            loss, aux, out = _composable(fn, loss_fn, schedule, rematerialise, params, buffers, micro, has_aux)
            if frozen:  # (its gradients may be an outer transform's: masked, not zeroed in place)
                out = out.with_received(
                    {u.name: drop_frozen(u, None, out.mask(u), frozen, out.layout) for u in out.plan.units}
                )
        else:
            check, checks["next"] = checks["next"], check_schedule == "always"
            guard_group = params.layout.guard_group
            with guarded(guard_group, "value_and_grad", timeout, check=check, rendezvous=check) as guard:
                result = sharded_pass(
                    fn,
                    loss_fn,
                    params,
                    buffers,
                    micro,
                    schedule=schedule,
                    remat=rematerialise,
                    has_aux=has_aux,
                    memo=memo,
                    frozen=frozen,
                    check_unchanged=guard is not None and guard.check,
                    compile=compiled,
                )
                masks = reached.merge(result.masks, params.layout)
            loss, aux, out = result.loss, result.aux, params.replace(result.grads).with_received(masks)
        return ((loss, aux) if has_aux else loss), out

    return run


class PassMemo:
    """What one call of the pass leaves for the next (kept by the caller: a ``TrainStep``, a
    ``value_and_grad`` function): the order the units ran in, which forward prefetch follows."""

    __slots__ = ("order", "plan")

    def __init__(self) -> None:
        self.order: list[str] = []
        self.plan: Plan | None = None  # the plan ``order`` names units of

    def order_for(self, plan: Plan) -> list[str]:
        """The last call's order, if it ran this plan (a state loaded under another grouping
        names other units): else none."""
        return self.order if plan is self.plan or plan == self.plan else []


class PassResult(NamedTuple):
    """What the pass over a step's micro-batches gives.

    Attributes:
        loss: the mean of the micro-batches' losses on this rank, detached.
        aux: the aux of ``loss_fn`` (``has_aux``), detached; a list with micro-batches.
        grads: each unit's gradient shard, the mean over micro-batches (zeros where no
            gradient came); empty when each unit was handed to ``on_unit`` instead.
        masks: which of each unit's parameters this rank's loss reached, frozen ones
            dropped (not yet merged over the ranks).
    """

    loss: torch.Tensor
    aux: Any
    grads: dict[str, torch.Tensor]
    masks: dict[str, tuple[bool, ...]]


OnUnit = Callable[[str, torch.Tensor, tuple[bool, ...]], None]


def sharded_pass(
    fn: Functional,
    loss_fn: LossFn,
    params: Sharded,
    buffers: Mapping[str, torch.Tensor],
    micro: Sequence[Any],
    *,
    schedule: Schedule,
    remat: Remat | None,
    has_aux: bool,
    memo: PassMemo,
    frozen: frozenset[str] = frozenset(),
    check_unchanged: bool = False,
    compile: Mapping[str, Any] | None = None,
    on_unit: OnUnit | None = None,
) -> PassResult:
    """The pass ``train_step`` and ``value_and_grad`` both run: the lean pass over ``micro``
    (micro-batches), one after the other, forward prefetch along ``memo``'s order.

    The result is the mean of their losses and gradients, reduced per micro-batch or
    (``reduce_each_micro_batch=False``) summed in full first and reduced once, as torch's
    ``no_sync``; parameters ``frozen`` since the plan count as reached by nothing (their
    elements zeroed). ``on_unit(unit, grad, received)`` (``update_in_backward``) gets each
    unit's gradient shard the moment it exists instead. Memory: what ``lean_pass`` holds,
    plus every unit's full gradient across micro-batches when they are summed before
    reducing. Runs inside the caller's guard.
    """
    plan, layout = params.plan, params.layout

    def without_frozen(unit: str, grad: torch.Tensor | None, mask: tuple[bool, ...]) -> tuple[bool, ...]:
        return drop_frozen(plan.unit(unit), grad, mask, frozen, layout) if frozen else mask

    deliver: OnUnit | None = None
    if on_unit is not None:
        step_unit = on_unit

        def deliver(unit: str, grad: torch.Tensor, received: tuple[bool, ...]) -> None:
            step_unit(unit, grad, without_frozen(unit, grad, received))

    deferred: dict[str, torch.Tensor] | None = {} if len(micro) > 1 and not schedule.reduce_each_micro_batch else None
    sink = GradSink(params, schedule, defer=deferred, on_unit=deliver)
    losses, auxes = [], []
    for mb in micro:
        with phase("setup"):
            runtime = LeanRuntime(
                fn,
                params,
                schedule=schedule,
                order_hint=memo.order_for(params.plan),
                sink=sink,
                remat=remat,
                check_unchanged=check_unchanged,
                compile=compile,
            )
        loss, aux = lean_pass(runtime, params, buffers, mb, loss_fn, has_aux)
        losses.append(loss)
        auxes.append(aux)
        memo.order, memo.plan = runtime.order, params.plan
    if deferred is not None:
        sink.reduce_deferred()
    totals = sink.totals if on_unit is None else {}
    masks = {u: without_frozen(u, totals.get(u), m) for u, m in sink.received_masks().items()}
    if len(micro) > 1:
        for g in totals.values():
            g.div_(len(micro))
    names = plan.unit_names if on_unit is None else ()  # (on_unit has had every gradient)
    grads = {u: totals[u] if u in totals else torch.zeros_like(params[u]) for u in names}
    loss = torch.stack(losses).mean() if len(losses) > 1 else losses[0]
    return PassResult(loss, auxes if len(micro) > 1 else auxes[0], grads, masks)


def _composable(
    fn: Functional,
    loss_fn: LossFn,
    schedule: Schedule,
    remat: Remat | None,
    params: Sharded,
    buffers: Mapping[str, torch.Tensor],
    micro: Sequence[Any],
    has_aux: bool,
) -> tuple[torch.Tensor, Any, Sharded]:
    """The composable path over ``micro`` (micro-batches): the mean of their losses, differentiated
    at once (every micro-batch's graph lives until then)."""
    aux_leaves: list[Any] = []
    aux_spec: Any = None

    def objective(shards: dict[str, torch.Tensor]) -> Any:
        nonlocal aux_leaves, aux_spec
        losses, auxes = [], []
        for batch in micro:
            runtime = ComposableRuntime(fn, params.replace(shards), schedule=schedule, remat=remat)
            with module_parameters_hidden(fn.module):
                model = model_handle(runtime, functools.partial(runtime.run, buffers))
                loss, aux = split_aux(loss_fn(model, batch), has_aux)
            losses.append(checked_loss(loss))
            auxes.append(aux)
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        if not has_aux:
            return loss
        # torch.func takes only tensors in an aux; the other leaves (a step count, a name) ride outside.
        aux_leaves, aux_spec = torch_pytree.tree_flatten(auxes[0] if len(auxes) == 1 else auxes)
        return loss, [t for t in aux_leaves if isinstance(t, torch.Tensor)]

    # Without an aux, none is returned: an outer jvp takes only tensors in its outputs.
    grads, value = grad_and_value(objective, has_aux=has_aux)(params.shards)
    if not has_aux:
        return value, None, params.replace(grads)
    loss, tensors = value
    it = iter(tensors)
    leaves = [next(it) if isinstance(t, torch.Tensor) else t for t in aux_leaves]
    return loss, torch_pytree.tree_unflatten(leaves, aux_spec), params.replace(grads)
