"""The sharded train step: ``value_and_grad``'s pass (``_grad.sharded_pass``), then the optimizer in place."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import optree
import torch
import torch.distributed as dist
import torch.utils._pytree as torch_pytree

from fsdp_fn import _reached as reached
from fsdp_fn._base import (
    GradientTransformation,
    Outcome,
    describe_kinds,
    state_kinds,
    update_in_place,
    whole_gradient_links,
)
from fsdp_fn._collectives import all_gather_into, all_reduce_, broadcast_
from fsdp_fn._functional import Functional
from fsdp_fn._grad import CheckSchedule, LossFn, PassMemo, compile_options, micro_batches, sharded_pass
from fsdp_fn._guard import Guard, guarded
from fsdp_fn._labels import label
from fsdp_fn._norms import square_norm
from fsdp_fn._phases import phase, phased
from fsdp_fn._plan import Policy, Unit, unit_label
from fsdp_fn._policy import Schedule
from fsdp_fn._predict import metrics_words
from fsdp_fn._remat import Remat
from fsdp_fn._shard import Layout, Sharded, ensure_live, sharded_in
from fsdp_fn._transforms import check_norm_type, global_norm
from fsdp_fn._tree import NAMESPACE, tree_map
from fsdp_fn._unfrozen import train_unfrozen

logger = logging.getLogger("fsdp_fn")

BufferSync = Literal["broadcast", "mean"] | None


class TrainState(NamedTuple):
    """Everything a step reads and returns. ``params`` and optimizer state are shards.

    Attributes:
        params: this rank's sharded parameters.
        opt_state: the optimizer's state (its ``init``'s), sharded like ``params``.
        buffers: the module's buffers by name, replicated: the same on every rank.
        step: updates applied so far: a step ``apply_if_finite`` rejected, a call
            ``accumulate`` deferred do not count.
    """

    params: Sharded
    opt_state: Any
    buffers: dict[str, torch.Tensor]  # replicated: the same on every rank
    step: int  # updates applied: a step apply_if_finite rejected, a call accumulate deferred do not count


class TrainStep:
    """The sharded train step: ``step(state, batch) -> (state, metrics)``; build with ``train_step``.

    ``model`` (``loss_fn``'s first argument) runs the module on the sharded parameters,
    gathering each unit just before it runs. The loss is this rank's loss on its part of
    the batch; gradients are averaged over ranks, so equal per-rank batches give the
    gradient of the global batch's mean loss. Gradient transformations are links of the
    optimizer's chain: ``chain(clip_by_global_norm(1.0), adamw())``,
    ``apply_if_finite(...)`` (a skipped step leaves the state as it was, buffers included;
    metrics say ``skipped``), ``accumulate(k, ...)``.

    Activations: rematerialised units' forward keeps only their inputs (and what the
    saving policy names), and their backward recomputes them inside the unit's one
    gather, so no collective is added. ``torch.utils.checkpoint.checkpoint`` calls in the
    model are routed the same way.

    Compilation: a unit whose module was compiled (``block.compile()``, as torchtitan does)
    runs its compiled code with the gathering around it, outside what Dynamo traces: one
    graph per unit, no graph break, no recompilation from step to step.

    Reliability: no step hangs silently. Waits on collectives notice a rank that raised
    (its error is raised here too, naming it), died, or stayed silent past ``timeout``
    seconds (named). Every step checks, inside its metrics all-gather, that all ranks
    issued the same collectives before the optimizer runs; ``check_schedule="first"``
    (default), ``"always"`` or ``"never"`` also has ranks agree before every collective,
    so a divergence is named at the unit where it starts (``step.check_next_step()`` asks
    for it on demand); on those steps each unit's forward is also checked for changing its
    own parameters in place (a change its gathered copy would lose).

    Args:
        fn: the model, from ``functionalize(module)``.
        loss_fn: ``loss_fn(model, batch) -> scalar``: calls ``model(*args, **kwargs)`` with
            whatever the module's forward takes (or a submodule or method through it,
            ``model.head(h)``: a ``ModelHandle``) and returns a floating scalar tensor.
        optimizer: a ``GradientTransformation`` (``adamw()``, ``sgd()``, ``chain(...)``,
            ``from_torch(opt)``).
        schedule: when things happen, as one value (``Schedule``): resharding after
            forward, prefetch, the in-flight limit, mixed precision, CPU offload, updating
            each unit during backward, and micro-batches (with ``micro_batches=N`` the batch
            is a sequence of N); ``None``: the default one.
        remat: rematerialise units: ``True`` (every non-root unit), a unit policy with the
            auto-wrap signature, a ``Remat`` with a saving policy and ``every``; ``None`` or
            ``False``: none.
        donate: ``True`` updates shards and optimizer state in place (the returned state
            reuses the input's tensors, and the input's may not be used again); ``False``
            leaves the input state intact (a copy of it: twice the state's memory).
        timeout: seconds a rank waits on the others before it raises ``RankFailure``.
        check_schedule: ``"first"`` (check the first step), ``"always"`` or ``"never"``:
            on checked steps ranks agree before every collective.
        buffer_sync: keeps replicated buffers (BatchNorm statistics) equal across ranks
            after each step: ``"broadcast"`` from rank 0 as DDP does, ``"mean"``, or
            ``None`` (no communication).
        has_aux: ``loss_fn`` returns ``(loss, aux)`` and ``metrics["aux"]`` is this rank's
            ``aux``, detached (a list of them with micro-batches): predictions, a metric.
        compile: ``True`` (or ``torch.compile``'s options as a dict) compiles every
            non-root unit's module that way for the step's calls, leaving the module itself
            as it was.

    Raises:
        TypeError: if ``fn`` is not a ``Functional``, ``loss_fn`` is not callable,
            ``optimizer`` is not a ``GradientTransformation``, ``schedule`` is not a
            ``Schedule``, ``compile`` is neither a bool nor a dict, or ``remat`` is not one
            of its kinds.
        ValueError: if ``timeout`` is not positive, ``check_schedule`` or ``buffer_sync``
            is not one of its values, or ``Schedule(update_in_backward=True)`` is combined
            with ``donate=False`` or an optimizer link that needs the whole gradient.
    """

    def __init__(
        self,
        fn: Functional,
        loss_fn: LossFn,
        optimizer: GradientTransformation,
        *,
        schedule: Schedule | None = None,
        remat: bool | Policy | Remat | None = None,
        donate: bool = True,
        timeout: float = 300.0,
        check_schedule: CheckSchedule = "first",
        buffer_sync: BufferSync = "broadcast",
        has_aux: bool = False,
        compile: bool | Mapping[str, Any] = False,
    ) -> None:
        if not isinstance(fn, Functional):
            raise TypeError(f"train_step wants the Functional from functionalize(module), got {type(fn).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
        if not isinstance(optimizer, GradientTransformation):
            raise TypeError(
                "optimizer must be an fsdp_fn GradientTransformation (adamw(), sgd(), chain(...), from_torch(opt)), "
                f"got {type(optimizer).__name__}"
            )
        schedule = Schedule() if schedule is None else schedule
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if check_schedule not in ("first", "always", "never"):
            raise ValueError(f"check_schedule must be 'first', 'always' or 'never', got {check_schedule!r}")
        if buffer_sync not in ("broadcast", "mean", None):
            raise ValueError(f"buffer_sync must be 'broadcast', 'mean' or None, got {buffer_sync!r}")
        if schedule.update_in_backward:
            whole = ["donate=False"] if not donate else []
            whole += whole_gradient_links(optimizer)  # (a global norm, a sum over calls)
            if whole:
                raise ValueError(
                    "Schedule(update_in_backward=True) steps each unit during backward, before the whole gradient "
                    f"exists; it cannot be combined with {', '.join(whole)}"
                )
        # Each non-root unit's module compiled (torch.compile's options), its gathering left out of the graph.
        self.compile = compile_options(compile)
        self.fn, self.loss_fn, self.optimizer, self.donate = fn, loss_fn, optimizer, donate
        self._kinds: Any = None  # the kinds of this optimizer's state (``state_kinds``), at the first call
        self.has_aux = has_aux
        self.schedule = schedule
        self.remat = Remat.of(remat)
        self.buffer_sync = buffer_sync
        # An optimizer that may apply nothing (apply_if_finite) has an outcome: buffers the forward
        # moved are restored when it rejects a step.
        self._may_skip = optimizer.outcome is not None
        self.memo = PassMemo()  # the order the last step ran the units in: forward prefetch follows it
        self.timeout, self.check_schedule = timeout, check_schedule
        self.calls = 0  # steps attempted: every rank counts the same
        self._check_next = check_schedule != "never"

    def check_next_step(self) -> None:
        """Run the next step in check mode: ranks agree on every collective before issuing it.

        A checked step costs one small exchange per collective and a fingerprint of each
        unit's parameters around its forward; a divergence is then named at the unit where
        it starts. Call it on every rank: every rank must check the same steps.
        """
        self._check_next = True

    def init(self, params: Sharded, buffers: Mapping[str, torch.Tensor] | None = None) -> TrainState:
        """The first state. Buffers (default: the module's) are copied and broadcast from rank 0, as DDP does.

        With ``cpu_offload`` the shards move to the CPU (and buffers to the compute device);
        with ``mixed_precision.buffer_dtype`` floating buffers are cast to it. Memory: the
        optimizer's state (AdamW: two shard-sized moments) and a copy of the buffers;
        communication: one broadcast per buffer (over the replicas too). Logs ``summary``
        at INFO to the ``fsdp_fn`` logger.

        Args:
            params: the sharded parameters (``shard`` or ``init_shards``); they become the
                state's (not copied, unless ``cpu_offload`` moves them).
            buffers: the buffers to start from, by name; ``None``: the module's
                (``fn.buffers``).

        Returns:
            The ``TrainState`` at step 0.

        Raises:
            TypeError: if ``params`` is not ``Sharded``.
            RuntimeError: if ``params`` was donated to a step or left half-updated by a
                failed one.
            RankFailure: if another rank failed or went silent for ``timeout``.
        """
        if not isinstance(params, Sharded):
            raise TypeError(f"init wants Sharded params (from shard()), got {type(params).__name__}")
        ensure_live(params, "init")
        source = self.fn.buffers if buffers is None else buffers
        device = self.schedule.cpu_offload.compute_device() if self.schedule.cpu_offload else None
        precision = self.schedule.mixed_precision
        copies = {k: v.detach().to(device=device, dtype=precision.buffer(v), copy=True) for k, v in source.items()}
        layout = params.layout
        for g in layout.groups:
            with guarded(g, "step.init", self.timeout):
                for b in copies.values():
                    broadcast_(b, g)
        if self.schedule.cpu_offload is not None:
            cpu = {k: tuple(t.to("cpu") for t in v) for k, v in layout.frozen.items()}
            params = Sharded(
                {k: v.to("cpu") for k, v in params.shards.items()},
                layout.with_frozen(cpu),
            )
        with label("optimizer"):
            opt_state = self.optimizer.init(params)
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s", self.summary(params))
        return TrainState(params, opt_state, copies, 0)

    def summary(self, params: Sharded) -> str:
        """One line: the plan, the schedule, remat and compilation this step runs with.

        What ``init`` logs at INFO to the ``fsdp_fn`` logger; Python's logging shows it once
        configured, e.g. ``logging.basicConfig(level=logging.INFO)``. No communication.

        Args:
            params: the sharded parameters (their plan and layout are read).

        Returns:
            The line: units, parameters, the largest gathered unit's size, the world, the
            schedule's options that differ from the defaults, remat, compilation and the
            optimizer's name.
        """
        plan, layout = params.plan, params.layout
        blocks = [u for u in plan.units if u.name and u.params]
        largest = max((u.gather_bytes(layout.world) for u in plan.units), default=0)
        changed = {
            f.name: getattr(self.schedule, f.name)
            for f in dataclasses.fields(self.schedule)
            if getattr(self.schedule, f.name) != f.default
        }
        remat = "off" if self.remat is None else f"{self.remat.policy.name}, every {self.remat.every}"
        return (
            f"fsdp_fn: {len(plan.units)} units ({len(blocks)} trainable non-root), "
            f"{plan.numel:,} parameters, the largest gathered "
            f"{largest / 2**20:.1f} MiB; world {layout.world}"
            + (f" x {layout.replicas} replicas" if layout.replicas > 1 else "")
            + f"; schedule: {changed or 'defaults'}; remat: {remat}; "
            f"compile: {'off' if self.compile is None else self.compile or 'on'}; optimizer: {self.optimizer.name}"
        )

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        """One step on this rank's part of the global batch.

        Memory: shards + units in flight + activations; full gradients exist one unit at a
        time (with ``update_in_backward`` the gradient shards too; with micro-batches and
        ``reduce_each_micro_batch=False`` every unit's full gradient lives across them).
        Communication: per unit, an all-gather in forward and in backward and one
        reduce-scatter (per micro-batch, or once with ``reduce_each_micro_batch=False``); one
        all-gather of a few numbers per rank (the metrics, the schedule check, which
        parameters got a gradient); with buffers, one broadcast (or all-reduce) of them per
        dtype. If the forward, the loss or the backward raises, ``state`` is untouched
        (with ``update_in_backward``, units already stepped make it unusable, and saying so
        is the next use's error). Parameters the loss never reached are not stepped, as
        torch.optim skips parameters whose ``.grad`` is ``None``.

        Args:
            state: the state ``init`` or the previous step returned; with ``donate=True``
                it is donated (its tensors hold the new state's values afterwards).
            batch: this rank's part of the global batch, as ``loss_fn`` takes it (with
                ``micro_batches=N``, a list of N).

        Returns:
            ``(new_state, metrics)``: ``metrics["loss"]`` is the mean loss over all ranks,
            ``"grad_norm"`` the global gradient norm, ``"skipped"`` whether the optimizer
            rejected the step (``apply_if_finite``), and with ``has_aux`` ``"aux"``: this
            rank's aux.

        Raises:
            RuntimeError: if called inside a ``torch.func`` transform, ``state`` was donated
                to an earlier step or left half-updated by a failed one, or the loss reaches
                a parameter of the module through a reference taken outside ``model(...)``.
            TypeError: if the optimizer state is not this step's optimizer's, or
                ``loss_fn`` does not return a floating scalar tensor (with ``has_aux``, a
                pair).
            ValueError: if ``donate=False`` with a ``from_torch`` optimizer, a batch has an
                empty leading dimension, the batch is not a list of ``micro_batches``, the
                loss does not require grad, or a parameter the plan holds frozen is
                trainable now.
            RankFailure: if another rank raised (its error is named), died, or went silent
                for ``timeout``.
            DivergenceError: if the ranks issued different collectives (named at the unit
                where they diverge on checked steps).
        """
        if torch._C._functorch.maybe_current_level() is not None:
            raise RuntimeError(
                "fsdp_fn: a train step cannot run inside a torch.func transform (grad, vjp, jvp, vmap): it updates "
                "the state in place and its gradients travel outside autograd, so the transform would see zeros; "
                "differentiate fsdp_fn.value_and_grad(fn, loss_fn) (or apply_sharded) instead"
            )
        ensure_live((state.params, state.opt_state), f"step {self.calls + 1}")
        if not self.donate and isinstance(state.opt_state, torch.optim.Optimizer):
            raise ValueError(
                "donate=False keeps the input state intact, but a from_torch optimizer keeps its state inside "
                "the torch optimizer object, which every step changes; use donate=True with from_torch, or "
                "ff.adamw / ff.sgd"
            )
        self._check_state_kinds(state)
        self.calls += 1
        check = self._check_next
        self._check_next = self.check_schedule == "always"
        with phase("setup"):
            guard = Guard(state.params.layout.guard_group, self.calls, timeout=self.timeout, check=check)
        with guard.active():
            with phase("setup"):
                # This rank's own input first: a rank that rejects it reports before any rank waits on it.
                unfrozen = state.params.plan.unfrozen(self.fn.module)
                micro = self._micro_batches(batch)
                for mb in micro:
                    _check_not_empty(mb, guard.rank)
                guard.enter(rendezvous=check)
                given = state
                if unfrozen:  # parameters frozen at make_plan, trainable now: into their units' training
                    params, opt_state = train_unfrozen(state.params, state.opt_state, self.optimizer, self.fn.module)
                    state = state._replace(params=params, opt_state=opt_state)
                frozen = state.params.plan.check_trainable(self.fn.module)
            new, metrics = self._step(state, micro, guard, frozen)
        if self.donate:
            _consume(
                (given.params, given.opt_state),
                f"these shards were donated to step {self.calls} (donate=True updates in place, so they hold "
                "that step's result now); use the state the step returned, or build the step with donate=False",
            )
        return new, metrics

    def _step(
        self, state: TrainState, micro: Sequence[Any], guard: Guard, frozen: frozenset[str] = frozenset()
    ) -> tuple[TrainState, dict[str, Any]]:
        params, opt_state, buffers = state.params, state.opt_state, state.buffers
        layout, plan = params.layout, params.plan
        # A skipped step must leave everything as it was, buffers the forward moves included.
        saved_buffers = {k: b.clone() for k, b in buffers.items()} if self._may_skip else None
        if not self.donate:  # the forward moves buffers in place too: copy them with the rest
            params, opt_state, buffers = tree_map(_clone, (params, opt_state, buffers))
        square_norms: dict[str, torch.Tensor] = {}
        stepped: list[str] = []  # update_in_backward: units already updated

        before = opt_state  # every unit's update starts from it: its tensors change in place, unit by unit,
        # and its counts (a schedule's) move once per step, not once per unit

        def step_unit(unit: str, grad: torch.Tensor, received: tuple[bool, ...]) -> None:
            nonlocal opt_state
            square_norms[unit] = _square_norm(layout, plan.unit(unit), grad)
            only = params.replace({u: grad if u == unit else params[u] for u in plan.unit_names})
            with phase("optimizer"):
                opt_state = update_in_place(self.optimizer, only.with_received({unit: received}), before, params)
            stepped.append(unit)

        schedule = self.schedule
        try:
            result = sharded_pass(
                self.fn,
                self.loss_fn,
                params,
                buffers,
                micro,
                schedule=schedule,
                remat=self.remat,
                has_aux=self.has_aux,
                memo=self.memo,
                frozen=frozen,
                check_unchanged=guard.check,
                compile=self.compile,
                on_unit=step_unit if schedule.update_in_backward else None,
            )
            loss, auxes = result.loss, result.aux
            outcome = Outcome.APPLIED
            if schedule.update_in_backward:  # (each unit was stepped with what any rank reached)
                stats, merged, _ = self._global(loss, square_norms.values(), result.masks, layout, guard, "")
            else:
                norms = (_square_norm(layout, plan.unit(u), g) for u, g in result.grads.items())
                stats, merged, _ = self._global(loss, norms, result.masks, layout, guard, "the step was not applied")
                grads = params.replace(result.grads).with_received(merged)
                with phase("optimizer"):
                    opt_state = update_in_place(self.optimizer, grads, opt_state, params)
                if self.optimizer.outcome is not None:
                    outcome = self.optimizer.outcome(opt_state)
                if saved_buffers is not None and outcome is Outcome.REJECTED:
                    for k, b in buffers.items():
                        b.copy_(saved_buffers[k])
                del grads
            del result
        except BaseException as e:
            if stepped:
                note = (
                    f"step {self.calls} failed after update_in_backward had already stepped units "
                    f"{', '.join(unit_label(u) for u in stepped)}: these shards and optimizer state are "
                    "half-updated and a retry would apply those updates twice; restore the last checkpoint"
                )
                _consume((state.params, state.opt_state), note)
                e.add_note(f"fsdp_fn: {note}")
            raise

        skipped = torch.tensor(outcome is Outcome.REJECTED)
        metrics: dict[str, Any] = {"loss": stats[0].float(), "grad_norm": stats[1].sqrt().float(), "skipped": skipped}
        if self.has_aux:
            metrics["aux"] = auxes
        for g in layout.groups:
            sync_buffers(buffers, g, self.buffer_sync)
        # TrainState.step counts the updates applied: not a rejected step, nor a call accumulate deferred
        new = TrainState(
            params.replace(params.shards), _fresh(opt_state), buffers, state.step + int(outcome is Outcome.APPLIED)
        )
        return new, metrics

    def _check_state_kinds(self, state: TrainState) -> None:
        """The optimizer state must be of this step's optimizer (its ``init``'s kinds: worked out
        once, on meta tensors), or its update would fail on a field it does not have."""
        if isinstance(state.opt_state, torch.optim.Optimizer):
            return
        if self._kinds is None:
            meta = state.params.replace({k: torch.empty_like(v, device="meta") for k, v in state.params.shards.items()})
            try:
                self._kinds = state_kinds(self.optimizer.init(meta))
            except Exception:  # an init that reads values: no check
                self._kinds = False
        if self._kinds is False:
            return
        got = state_kinds(state.opt_state)
        if got != self._kinds:
            raise TypeError(
                f"the optimizer state given to this step is not {self.optimizer.name}'s: it holds "
                f"{describe_kinds(got)} where {self.optimizer.name} keeps {describe_kinds(self._kinds)}. Make the "
                "state with this step's init (step.init(params)), or load a checkpoint into a state it made"
            )

    def _micro_batches(self, batch: Any) -> Sequence[Any]:
        return micro_batches(self.schedule, batch)  # (shared with value_and_grad)

    @staticmethod
    @phased("metrics")
    def _global(
        loss: torch.Tensor,
        square_norms: Any,
        masks: Mapping[str, tuple[bool, ...]],
        layout: Layout,
        guard: Guard,
        consequence: str,
    ) -> tuple[torch.Tensor, dict[str, tuple[bool, ...]], bool]:
        """One all-gather of a few numbers per rank: [mean loss over all ranks, squared global
        gradient norm], which parameters got a gradient on any rank (and whether every rank
        agrees), and a check that every rank issued the same collectives (an all-reduce
        more with replicas)."""
        plan = layout.plan
        zero = torch.zeros((), dtype=torch.float64, device=loss.device)
        norms = [n if n.device == loss.device else n.to(loss.device) for n in square_norms]
        square = torch.stack(norms).sum() if norms else zero  # (two operations, not two per unit)
        lo, hi = guard.fingerprint()
        packed = reached.pack(masks, plan)
        mine = torch.cat([torch.stack([loss.double(), square, zero + lo, zero + hi]), packed.to(loss.device)])
        width = metrics_words(plan)
        everyone = torch.empty(layout.world * width, dtype=torch.float64, device=loss.device)
        all_gather_into(everyone, mine, layout.group, None)
        everyone = everyone.view(layout.world, width)
        guard.compare(everyone[:, 2:4].cpu(), consequence or "the units' updates were already applied")
        merged, same = reached.unpack_any(everyone[:, 4:], plan)
        # (replicas hold the same gradient shards: their norms are counted once)
        merged, stats = reached.over_replicas(merged, layout, everyone[:, :2].sum(0))
        assert stats is not None
        if layout.tensor_axis is not None:  # its ranks count the parameters each splits (the loss is theirs alike)
            stats[1] = all_reduce_(stats[1:2].clone(), layout.tensor_axis.group)[0]
        stats[1] /= layout.replicas
        stats[0] /= layout.world * layout.replicas
        return stats, merged, same


def _square_norm(layout: Layout, unit: Unit, grad: torch.Tensor) -> torch.Tensor:
    """The squared norm of this rank's part of ``unit``'s gradient that the whole model's norm counts
    (``Layout.counted_parts``: all of it, but under tensor parallelism)."""
    if layout.tensor_axis is None:
        return square_norm(grad)
    parts = layout.counted_parts(unit, grad.reshape(-1))
    return torch.stack([square_norm(x) for x in parts]).sum() if parts else grad.new_zeros((), dtype=torch.float64)


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def _consume(tree: Any, why: str) -> None:
    for node in sharded_in(tree):
        node.consumed = why


def _fresh(tree: Any) -> Any:
    """The same tensors in new ``Sharded`` nodes (the old ones are marked consumed)."""
    return optree.tree_map(
        lambda x: x.replace(x.shards) if isinstance(x, Sharded) else x,
        tree,
        is_leaf=lambda x: isinstance(x, Sharded),
        none_is_leaf=True,
        namespace=NAMESPACE,
    )


def _check_not_empty(batch: Any, rank: int) -> None:
    for leaf in torch_pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == 0:
            raise ValueError(
                f"the batch on rank {rank} has an empty leading dimension (a tensor of shape {tuple(leaf.shape)}); "
                "every rank needs at least one example, or its mean loss is NaN"
            )


def clip_grad_norm_(grads: Sharded, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale sharded gradients in place so their global norm is at most ``max_norm``; return the norm.

    ``torch.nn.utils.clip_grad_norm_``'s rule on the unsharded gradients (padding is zero
    and adds nothing), with the exact global ``norm_type``-norm of ``global_norm``. Memory:
    none beyond a number; communication: one all-reduce of one number (two with replicas;
    of ``W`` numbers for ``math.inf``).

    Args:
        grads: the sharded gradients (``value_and_grad``'s); changed in place.
        max_norm: the largest global norm, a positive finite number.
        norm_type: ``p`` of the norm, a number ``> 0`` or ``math.inf`` (torch's
            ``norm_type``: 1, 2, inf, any ``p``).

    Returns:
        The global norm before clipping, a float32 0-d tensor.

    Raises:
        ValueError: if ``max_norm`` is not a positive finite number or ``norm_type`` is not
            ``> 0``.
        TypeError: if ``norm_type`` is not a number.
    """
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"clip_grad_norm_: max_norm must be a positive finite number, got {max_norm!r}")
    p = check_norm_type(norm_type, "clip_grad_norm_(norm_type)")
    norm = global_norm(grads, p)
    coef = torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)
    for unit in grads.plan.units:
        if any(grads.mask(unit)):
            grads[unit.name].mul_(coef.to(grads[unit.name].device))
    return norm.float()


def sync_buffers(buffers: Mapping[str, torch.Tensor], group: dist.ProcessGroup, mode: BufferSync) -> None:
    """Make replicated buffers equal on every rank again after a forward moved them.

    Communication: one collective per buffer dtype (buffers flattened together); memory:
    one flat copy of the buffers of one dtype at a time.

    Args:
        buffers: the replicated buffers by name; changed in place.
        group: the ranks that must agree (a group of one: nothing to do).
        mode: ``"broadcast"``: rank 0's values win (DDP's rule). ``"mean"``: floating
            buffers are averaged (every rank's statistics count); integer ones are left as
            they are (equal by construction, e.g. ``num_batches_tracked``). ``None``: no
            communication.
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


# The JAX-style builder name; the class is the builder, so every option is typed.
train_step = TrainStep
