"""The sharded train step: ``torch.func.grad`` over the gathered forward, then the optimizer."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple, cast

import torch
import torch.distributed as dist
from torch.func import vjp

from fsdp_fn._collectives import all_reduce_, broadcast_
from fsdp_fn._functional import Functional
from fsdp_fn._gather import BackwardPrefetch, Runtime, Schedule
from fsdp_fn._memory import label
from fsdp_fn._optim import Optimizer, select_units, tree_map
from fsdp_fn._shard import Sharded

LossFn = Callable[[Callable[..., Any], Any], torch.Tensor]


class TrainState(NamedTuple):
    """Everything a step reads and returns. ``params`` and optimizer state are shards."""

    params: Sharded
    opt_state: Any
    buffers: dict[str, torch.Tensor]  # replicated: the same on every rank
    step: int


class TrainStep:
    """``step(state, batch) -> (state, metrics)``; build with ``train_step``."""

    def __init__(
        self,
        fn: Functional,
        loss_fn: LossFn,
        optimizer: Optimizer,
        *,
        donate: bool = True,
        reshard_after_forward: bool = True,
        update_in_backward: bool = False,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch: bool = True,
        max_inflight: int = 2,
        buffer_sync: BufferSync = "broadcast",
    ) -> None:
        if not isinstance(fn, Functional):
            raise TypeError(f"train_step wants the Functional from functionalize(module), got {type(fn).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                "optimizer must be an fsdp_fn Optimizer (adamw(), sgd(), from_torch(opt)), "
                f"got {type(optimizer).__name__}"
            )
        if update_in_backward and not donate:
            raise ValueError("update_in_backward writes the shards during backward; it needs donate=True")
        self.fn, self.loss_fn, self.optimizer, self.donate = fn, loss_fn, optimizer, donate
        self.schedule = Schedule(reshard_after_forward, backward_prefetch, forward_prefetch, max_inflight)
        self.update_in_backward = update_in_backward
        if buffer_sync not in ("broadcast", "mean", None):
            raise ValueError(f"buffer_sync must be 'broadcast', 'mean' or None, got {buffer_sync!r}")
        self.buffer_sync = buffer_sync
        self.unit_order: list[str] = []  # the order the last step ran the units in: forward prefetch follows it

    def init(self, params: Sharded, buffers: Mapping[str, torch.Tensor] | None = None) -> TrainState:
        """The first state. Buffers (default: the module's) are copied and broadcast from rank 0, as DDP does."""
        if not isinstance(params, Sharded):
            raise TypeError(f"init wants Sharded params (from shard()), got {type(params).__name__}")
        source = self.fn.buffers if buffers is None else buffers
        copies = {k: v.detach().clone() for k, v in source.items()}
        for b in copies.values():
            broadcast_(b, params.group)
        with label("optimizer"):
            opt_state = self.optimizer.init(params)
        return TrainState(params, opt_state, copies, 0)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        """One step on this rank's part of the global batch.

        Memory: shards + units in flight + activations; full gradients exist one unit at a
        time (with ``update_in_backward`` the gradient shards too). Communication: per
        unit, an all-gather in forward and in backward and one reduce-scatter; one
        all-reduce of two numbers for the metrics; with buffers, one broadcast (or all-reduce)
        of them per dtype. If the forward or
        the loss raises, ``state`` is untouched. Units the forward never ran are not stepped
        (as torch.optim skips parameters without a gradient).
        """
        params = state.params
        opt_state = state.opt_state
        if not self.donate:
            params, opt_state = tree_map(torch.clone, (params, opt_state))
        square_norms: dict[str, torch.Tensor] = {}

        def step_unit(unit: str, grad: torch.Tensor) -> None:
            square_norms[unit] = _square_norm(grad)
            one = [unit]
            self.optimizer.update(
                select_units(params.replace_one(unit, grad), one),
                select_units(opt_state, one),
                select_units(params, one),
            )

        runtime = Runtime(
            self.fn,
            params,
            schedule=self.schedule,
            order_hint=self.unit_order,
            on_grad=step_unit if self.update_in_backward else None,
        )

        def objective(shards: dict[str, torch.Tensor]) -> torch.Tensor:
            model = functools.partial(runtime.run_on, params.replace(shards), state.buffers)
            loss = self.loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
                got = (
                    f"shape {tuple(loss.shape)} {loss.dtype}" if isinstance(loss, torch.Tensor) else type(loss).__name__
                )
                raise TypeError(f"loss_fn must return a floating scalar tensor, got {got}")
            return loss.reshape(())

        # vjp rather than grad: grad always differentiates with create_graph=True, which keeps
        # every backward intermediate alive for a second derivative nobody asked for.
        loss, vjp_fn = vjp(objective, params.shards)  # type: ignore[misc]
        (grad_shards,) = vjp_fn(torch.ones_like(loss), retain_graph=False, create_graph=False)
        runtime.drain()  # the reduce-scatters still in flight, before anything reads a gradient
        self.unit_order = runtime.order
        used = [u for u in params.plan.unit_names if u in runtime.gathers]
        if not self.update_in_backward:
            grads = params.replace(grad_shards)
            for u in used:
                square_norms[u] = _square_norm(grads[u])
            if len(used) == len(params):
                self.optimizer.update(grads, opt_state, params)
            else:
                self.optimizer.update(
                    select_units(grads, used), select_units(opt_state, used), select_units(params, used)
                )
            del grads, grad_shards

        zero = torch.zeros((), dtype=torch.float64, device=loss.device)
        stats = torch.stack([loss.detach().double(), sum((n.to(loss.device) for n in square_norms.values()), zero)])
        all_reduce_(stats, params.group)
        metrics = {"loss": (stats[0] / params.layout.world).float(), "grad_norm": stats[1].sqrt().float()}
        sync_buffers(state.buffers, params.group, self.buffer_sync)
        return TrainState(params, opt_state, state.buffers, state.step + 1), metrics


def _square_norm(t: torch.Tensor) -> torch.Tensor:
    # One fast fp32 pass (as clip_grad_norm_ does), squared in float64 for the sum over units.
    return cast(torch.Tensor, torch.linalg.vector_norm(t).double().square())


BufferSync = Literal["broadcast", "mean"] | None


def sync_buffers(buffers: Mapping[str, torch.Tensor], group: dist.ProcessGroup, mode: BufferSync) -> None:
    """Make replicated buffers equal on every rank again after a forward moved them.

    ``"broadcast"``: rank 0's values win (DDP's rule). ``"mean"``: floating buffers are
    averaged (every rank's statistics count); integer ones are left as they are (equal
    by construction, e.g. ``num_batches_tracked``). ``None``: no communication.
    Communication: one collective per buffer dtype (buffers flattened together).
    """
    if mode is None or group.size() == 1 or not buffers:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in buffers.values():
        if mode == "broadcast" or b.is_floating_point():
            by_dtype.setdefault(b.dtype, []).append(b)
    for tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if mode == "broadcast":
            broadcast_(flat, group)
        else:
            all_reduce_(flat, group).div_(group.size())
        at = 0
        for t in tensors:
            t.copy_(flat[at : at + t.numel()].view_as(t))
            at += t.numel()


def train_step(
    fn: Functional,
    loss_fn: LossFn,
    optimizer: Optimizer,
    *,
    donate: bool = True,
    reshard_after_forward: bool = True,
    update_in_backward: bool = False,
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
    forward_prefetch: bool = True,
    max_inflight: int = 2,
    buffer_sync: BufferSync = "broadcast",
) -> TrainStep:
    """Build the sharded train step.

    ``loss_fn(model, batch) -> scalar`` calls ``model(*args, **kwargs)`` with whatever its
    forward takes; ``model`` runs the module on the sharded parameters, gathering each unit
    just before it runs. The loss is this rank's loss on its part of the batch; gradients
    are averaged over ranks, so equal per-rank batches give the gradient of the global
    batch's mean loss. ``donate=True`` updates shards and optimizer state in place (the
    returned state reuses the input's tensors); ``False`` leaves the input state intact.
    ``reshard_after_forward=False`` keeps each unit gathered from its forward to its
    backward (one all-gather less per unit, more memory: like ZeRO-2 / ``SHARD_GRAD_OP``).
    ``update_in_backward=True`` steps each unit's optimizer as soon as its gradient shard
    is reduce-scattered, so the gradient shards of all units never live at once.
    ``backward_prefetch`` (``BACKWARD_PRE``, ``BACKWARD_POST``, ``None``) and
    ``forward_prefetch`` issue the next unit's all-gather early, overlapping it with
    compute; ``max_inflight`` caps the non-root units gathered at once (prefetch included).
    ``buffer_sync`` keeps replicated buffers (BatchNorm statistics) equal across ranks after
    each step: ``"broadcast"`` from rank 0 as DDP does, ``"mean"``, or ``None``.

    >>> import torch, torch.nn.functional as F
    >>> def loss_fn(model, batch):
    ...     x, y = batch
    ...     return F.mse_loss(model(x), y)
    """
    return TrainStep(
        fn,
        loss_fn,
        optimizer,
        donate=donate,
        reshard_after_forward=reshard_after_forward,
        update_in_backward=update_in_backward,
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
        max_inflight=max_inflight,
        buffer_sync=buffer_sync,
    )
