"""The sharded train step: ``torch.func.vjp`` over the gathered forward, then the optimizer."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.utils._pytree as torch_pytree
from torch.func import vjp

from fsdp_fn._collectives import all_gather_into, all_reduce_, broadcast_
from fsdp_fn._functional import Functional
from fsdp_fn._gather import Runtime
from fsdp_fn._guard import Guard
from fsdp_fn._memory import label
from fsdp_fn._optim import Optimizer, select_units, tree_leaves, tree_map
from fsdp_fn._policy import BackwardPrefetch, CPUOffload, MixedPrecision, Schedule
from fsdp_fn._shard import Layout, Sharded

LossFn = Callable[[Callable[..., Any], Any], torch.Tensor]
BufferSync = Literal["broadcast", "mean"] | None
Accumulate = Literal["sharded", "full"]
CheckSchedule = Literal["first", "always", "never"]


class TrainState(NamedTuple):
    """Everything a step reads and returns. ``params`` and optimizer state are shards."""

    params: Sharded
    opt_state: Any
    buffers: dict[str, torch.Tensor]  # replicated: the same on every rank
    step: int


class TrainStep:
    """The sharded train step: ``step(state, batch) -> (state, metrics)``; build with ``train_step``.

    ``loss_fn(model, batch) -> scalar`` calls ``model(*args, **kwargs)`` with whatever its
    forward takes; ``model`` runs the module on the sharded parameters, gathering each unit
    just before it runs. The loss is this rank's loss on its part of the batch; gradients
    are averaged over ranks, so equal per-rank batches give the gradient of the global
    batch's mean loss. ``donate=True`` updates shards and optimizer state in place (the
    returned state reuses the input's tensors); ``False`` leaves the input state intact.

    Memory and overlap: ``reshard_after_forward=False`` keeps each unit gathered from its
    forward to its backward (one all-gather less per unit, more memory: ZeRO-2 /
    ``SHARD_GRAD_OP``). ``update_in_backward=True`` steps each unit's optimizer as soon as
    its gradient shard is reduce-scattered, so the gradient shards of all units never live
    at once. ``backward_prefetch`` (``BACKWARD_PRE``, ``BACKWARD_POST``, ``None``) and
    ``forward_prefetch`` issue the next unit's all-gather early, overlapping it with
    compute; ``max_inflight`` caps the non-root units gathered at once (prefetch included).

    Training features: ``mixed_precision`` (``MixedPrecision``), ``cpu_offload``
    (``CPUOffload``), ``accumulation=N`` micro-batches per step (the batch is then a
    sequence of N; ``accumulate="sharded"`` reduce-scatters each, ``"full"`` keeps full
    gradients and reduce-scatters once, like ``no_sync``), ``clip_grad_norm`` (the global
    norm over all shards, as ``torch.nn.utils.clip_grad_norm_``), ``skip_nonfinite`` (a
    step whose loss or gradient norm is not finite leaves the state as it was; metrics say
    ``skipped``). ``buffer_sync`` keeps replicated buffers (BatchNorm statistics) equal
    across ranks after each step: ``"broadcast"`` from rank 0 as DDP does, ``"mean"``, or
    ``None``.

    Reliability: no step hangs silently. Waits on collectives notice a rank that raised
    (its error is raised here too, naming it), died, or stayed silent past ``timeout``
    seconds (named). Every step checks, inside its metrics all-gather, that all ranks
    issued the same collectives before the optimizer runs; ``check_schedule="first"``
    (default), ``"always"`` or ``"never"`` also has ranks agree before every collective,
    so a divergence is named at the unit where it starts (``step.check_next_step()`` asks
    for it on demand).
    """

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
        mixed_precision: MixedPrecision | None = None,
        cpu_offload: CPUOffload | None = None,
        accumulation: int = 1,
        accumulate: Accumulate = "sharded",
        clip_grad_norm: float | None = None,
        skip_nonfinite: bool = False,
        timeout: float = 300.0,
        check_schedule: CheckSchedule = "first",
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
        if not isinstance(accumulation, int) or accumulation < 1:
            raise ValueError(f"accumulation must be a whole number of micro-batches >= 1, got {accumulation!r}")
        if accumulate not in ("sharded", "full"):
            raise ValueError(
                f"accumulate must be 'sharded' (reduce-scatter each micro-batch) or 'full', got {accumulate!r}"
            )
        if clip_grad_norm is not None and not (clip_grad_norm > 0 and math.isfinite(clip_grad_norm)):
            raise ValueError(f"clip_grad_norm must be a positive finite number, got {clip_grad_norm!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if check_schedule not in ("first", "always", "never"):
            raise ValueError(f"check_schedule must be 'first', 'always' or 'never', got {check_schedule!r}")
        if buffer_sync not in ("broadcast", "mean", None):
            raise ValueError(f"buffer_sync must be 'broadcast', 'mean' or None, got {buffer_sync!r}")
        if update_in_backward:
            conflicts = {
                "donate=False": not donate,
                "clip_grad_norm": clip_grad_norm is not None,
                "skip_nonfinite": skip_nonfinite,
                "accumulation > 1": accumulation > 1,
            }
            named = [k for k, v in conflicts.items() if v]
            if named:
                raise ValueError(
                    f"update_in_backward steps each unit during backward, before the whole gradient exists; "
                    f"it cannot be combined with {', '.join(named)}"
                )
        self.fn, self.loss_fn, self.optimizer, self.donate = fn, loss_fn, optimizer, donate
        self.schedule = Schedule(
            reshard_after_forward,
            backward_prefetch,
            forward_prefetch,
            max_inflight,
            mixed_precision or MixedPrecision(),
            cpu_offload,
        )
        self.update_in_backward = update_in_backward
        self.buffer_sync = buffer_sync
        self.accumulation, self.accumulate = accumulation, accumulate
        self.clip_grad_norm, self.skip_nonfinite = clip_grad_norm, skip_nonfinite
        self.unit_order: list[str] = []  # the order the last step ran the units in: forward prefetch follows it
        self.timeout, self.check_schedule = timeout, check_schedule
        self.calls = 0  # steps attempted: every rank counts the same
        self._check_next = check_schedule != "never"

    def check_next_step(self) -> None:
        """Run the next step in check mode: ranks agree on every collective before issuing it."""
        self._check_next = True

    def init(self, params: Sharded, buffers: Mapping[str, torch.Tensor] | None = None) -> TrainState:
        """The first state. Buffers (default: the module's) are copied and broadcast from rank 0, as DDP does.

        With ``cpu_offload`` the shards move to the CPU (and buffers to the compute device);
        with ``mixed_precision.buffer_dtype`` floating buffers are cast to it.
        """
        if not isinstance(params, Sharded):
            raise TypeError(f"init wants Sharded params (from shard()), got {type(params).__name__}")
        source = self.fn.buffers if buffers is None else buffers
        device = self.schedule.cpu_offload.compute_device() if self.schedule.cpu_offload else None
        dtype = self.schedule.mixed_precision.buffer_dtype
        copies = {
            k: v.detach().to(
                device=device, dtype=dtype if dtype is not None and v.is_floating_point() else None, copy=True
            )
            for k, v in source.items()
        }
        layout = params.layout
        for g in (layout.group, layout.replicate):
            if g is not None:
                for b in copies.values():
                    broadcast_(b, g)
        if self.schedule.cpu_offload is not None:
            cpu = {k: v.to("cpu") for k, v in layout.frozen.items()}
            params = Sharded(
                {k: v.to("cpu") for k, v in params.shards.items()},
                Layout(layout.plan, layout.group, cpu, layout.replicate),
            )
        with label("optimizer"):
            opt_state = self.optimizer.init(params)
        return TrainState(params, opt_state, copies, 0)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        """One step on this rank's part of the global batch.

        Memory: shards + units in flight + activations; full gradients exist one unit at a
        time (with ``update_in_backward`` the gradient shards too; with
        ``accumulate="full"`` every unit's full gradient lives across the micro-batches).
        Communication: per unit, an all-gather in forward and in backward and one
        reduce-scatter (per micro-batch, except with ``accumulate="full"``: once); one
        all-gather of four numbers per rank (the metrics and the schedule check); with
        buffers, one broadcast (or all-reduce) of them per dtype. If the forward or the loss
        raises, ``state`` is untouched. Units the forward never ran are not stepped (as torch.optim skips
        parameters without a gradient).
        """
        self.calls += 1
        check = self._check_next
        self._check_next = self.check_schedule == "always"
        guard = Guard(state.params.group, self.calls, timeout=self.timeout, check=check)
        with guard.active():
            return self._step(state, batch, guard)

    def _step(self, state: TrainState, batch: Any, guard: Guard) -> tuple[TrainState, dict[str, torch.Tensor]]:
        params, opt_state, buffers = state.params, state.opt_state, state.buffers
        layout = params.layout
        micro = self._micro_batches(batch)
        for mb in micro:
            _check_not_empty(mb, guard.rank)
        # A skipped step must leave everything as it was, buffers the forward moves included.
        saved_buffers = {k: b.clone() for k, b in buffers.items()} if self.skip_nonfinite else None
        if not self.donate:  # the forward moves buffers in place too: copy them with the rest
            params, opt_state, buffers = tree_map(torch.clone, (params, opt_state, buffers))
        square_norms: dict[str, torch.Tensor] = {}

        def step_unit(unit: str, grad: torch.Tensor) -> None:
            square_norms[unit] = _square_norm(grad)
            one = [unit]
            self.optimizer.update(
                select_units(params.replace_one(unit, grad), one),
                select_units(opt_state, one),
                select_units(params, one),
            )

        # Gradient shards arrive through on_grad as each unit's reduce-scatter completes (in the
        # background of the rest of backward); vjp's own result is all zeros and unused.
        total: dict[str, torch.Tensor] = {}

        def collect(unit: str, grad: torch.Tensor) -> None:
            total[unit] = total[unit].add_(grad) if unit in total else grad

        deferred: dict[str, torch.Tensor] | None = {} if self.accumulation > 1 and self.accumulate == "full" else None
        losses = []
        used: dict[str, None] = {}
        runtime = None
        for mb in micro:
            runtime = Runtime(
                self.fn,
                params,
                schedule=self.schedule,
                order_hint=self.unit_order,
                on_grad=step_unit if self.update_in_backward else collect,
                deferred=deferred,
            )
            losses.append(self._forward_backward(runtime, params, buffers, mb))
            used.update(dict.fromkeys(runtime.gathers))
            self.unit_order = runtime.order
        assert runtime is not None
        if deferred is not None:  # accumulate="full": one reduce-scatter per unit, now
            total = {u.name: runtime.reduce(u, deferred.pop(u.name))() for u in params.plan.units if u.name in deferred}
        loss = torch.stack(losses).mean() if len(losses) > 1 else losses[0]
        order = [u for u in params.plan.unit_names if u in used]
        skipped = torch.zeros((), dtype=torch.bool)

        if self.update_in_backward:
            stats = self._global(loss, square_norms.values(), layout, guard, "the units' updates were already applied")
        else:
            if len(micro) > 1:
                for g in total.values():
                    g.div_(len(micro))
            grads = params.replace({u: total.get(u, torch.zeros_like(params[u])) for u in params.plan.unit_names})
            stats = self._global(
                loss, (_square_norm(grads[u]) for u in order), layout, guard, "the step was not applied"
            )
            norm = stats[1].sqrt()
            # Reading the verdict on the host is a sync: only when the guard is asked for.
            if self.skip_nonfinite and not bool(torch.isfinite(stats).all()):
                skipped = torch.ones((), dtype=torch.bool)
                assert saved_buffers is not None
                for k, b in buffers.items():
                    b.copy_(saved_buffers[k])
            else:
                if self.clip_grad_norm is not None:
                    _scale(grads, self.clip_grad_norm, norm)
                update = (grads, opt_state, params)
                if len(order) < len(params):
                    update = tuple(select_units(tree, order) for tree in update)  # type: ignore[assignment]
                self.optimizer.update(*update)
            del grads, total

        metrics = {"loss": stats[0].float(), "grad_norm": stats[1].sqrt().float(), "skipped": skipped}
        sync_buffers(buffers, layout.group, self.buffer_sync)
        if layout.replicate is not None:
            sync_buffers(buffers, layout.replicate, self.buffer_sync)
        return TrainState(params, opt_state, buffers, state.step + int(not skipped)), metrics

    def _micro_batches(self, batch: Any) -> Sequence[Any]:
        if self.accumulation == 1:
            return [batch]
        if not isinstance(batch, Sequence) or len(batch) != self.accumulation:
            got = f"{len(batch)} items" if isinstance(batch, Sequence) else type(batch).__name__
            raise ValueError(
                f"with accumulation={self.accumulation} the batch must be a sequence of that many "
                f"micro-batches, got {got}"
            )
        return batch

    def _forward_backward(
        self, runtime: Runtime, params: Sharded, buffers: dict[str, torch.Tensor], batch: Any
    ) -> torch.Tensor:
        """This rank's loss; the gradient shards go to the runtime's ``on_grad`` as they are ready."""

        def objective(shards: dict[str, torch.Tensor]) -> torch.Tensor:
            model = functools.partial(runtime.run_on, params.replace(shards), buffers)
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
        vjp_fn(torch.ones_like(loss), retain_graph=False, create_graph=False)
        runtime.drain()  # the reduce-scatters still in flight, before anything reads a gradient
        return cast(torch.Tensor, loss.detach())

    @staticmethod
    def _global(loss: torch.Tensor, square_norms: Any, layout: Layout, guard: Guard, consequence: str) -> torch.Tensor:
        """[mean loss over all ranks, squared global gradient norm], and a check that every rank
        issued the same collectives: one all-gather of four numbers (and an all-reduce with replicas)."""
        zero = torch.zeros((), dtype=torch.float64, device=loss.device)
        square = sum((n.to(loss.device) for n in square_norms), zero)
        lo, hi = guard.fingerprint()
        mine = torch.stack([loss.double(), square, zero + lo, zero + hi])
        everyone = torch.empty(layout.world * 4, dtype=torch.float64, device=loss.device)
        all_gather_into(everyone, mine, layout.group, None)
        everyone = everyone.view(layout.world, 4)
        guard.compare(everyone[:, 2:].cpu(), consequence)
        stats = everyone[:, :2].sum(0)
        if layout.replicate is not None:  # replicas hold the same gradient shards: count them once
            all_reduce_(stats, layout.replicate)
            stats[1] /= layout.replicas
        stats[0] /= layout.world * layout.replicas
        return stats


def _check_not_empty(batch: Any, rank: int) -> None:
    for leaf in torch_pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == 0:
            raise ValueError(
                f"the batch on rank {rank} has an empty leading dimension (a tensor of shape {tuple(leaf.shape)}); "
                "every rank needs at least one example, or its mean loss is NaN"
            )


def _square_norm(t: torch.Tensor) -> torch.Tensor:
    # One fp32 pass in short rows, summed in float64: a flat shard's one long fp32 sum drifts ~1e-4.
    from fsdp_fn._norms import square_norm

    return square_norm(t)


def _scale(grads: Sharded, max_norm: float, norm: torch.Tensor) -> None:
    # torch.nn.utils.clip_grad_norm_'s rule, to the digit.
    coef = torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)
    for g in tree_leaves(grads):
        g.mul_(coef.to(g.device))


def clip_grad_norm_(grads: Sharded, max_norm: float) -> torch.Tensor:
    """Scale sharded gradients in place so their global norm is at most ``max_norm``; return the norm.

    Exactly ``torch.nn.utils.clip_grad_norm_`` on the unsharded gradients (padding is
    zero and adds nothing). Communication: one all-reduce of one number (two with replicas).
    """
    layout = grads.layout
    square = sum((_square_norm(g) for g in tree_leaves(grads)), torch.zeros((), dtype=torch.float64))
    stats = torch.stack([torch.zeros((), dtype=torch.float64), square])
    all_reduce_(stats, layout.group)
    if layout.replicate is not None:
        all_reduce_(stats, layout.replicate).div_(layout.replicas)
    norm = stats[1].sqrt().float()
    _scale(grads, max_norm, norm)
    return norm


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


def train_step(fn: Functional, loss_fn: LossFn, optimizer: Optimizer, **options: Any) -> TrainStep:
    """Build the sharded train step: ``TrainStep(fn, loss_fn, optimizer, **options)`` (options there).

    >>> import torch, torch.nn.functional as F
    >>> def loss_fn(model, batch):
    ...     x, y = batch
    ...     return F.mse_loss(model(x), y)
    """
    return TrainStep(fn, loss_fn, optimizer, **options)
