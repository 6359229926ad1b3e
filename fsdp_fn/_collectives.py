"""All-gather and reduce-scatter as one differentiable pair, and a log of every collective.

``all_gather`` transposes into ``reduce_scatter`` and back, as JAX's ``all_gather`` and
``psum_scatter`` do: the backward of each is the other. Both are linear, so the tangent
of each (forward mode) is the same collective of the tangent; under ``vmap`` each runs
once over the flattened batch, after one small exchange that checks every rank's batch
is as large. Every rule calls the pair's differentiable ``apply``
again, so nested transforms (grad of grad, jvp of grad, vmap of grad, jacrev, jacfwd,
hessian) see every collective they need. Both are ``torch.autograd.Function``s with a
separate ``setup_context``, as ``torch.func`` requires; the collectives themselves run
with functorch disabled on plain tensors (they write into buffers, which a transform
would refuse), through the group's ``Comm`` (``_comm.py``), chosen once per group
(``comm_of``) or set by the user (``set_comm``). Every collective is logged (``comm_log``)
and checked by the guard here, before the comm is called, whichever comm it is.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from fsdp_fn import _guard
from fsdp_fn._comm import Comm, default_comm
from fsdp_fn._function import plain_mode
from fsdp_fn._labels import retag
from fsdp_fn._phases import phased
from fsdp_fn._shm import SharedMemoryComm, shared_memory_here


@dataclass(frozen=True)
class Collective:
    """One collective as issued by this rank (a record of a ``CommLog``).

    Attributes:
        op: which collective: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``,
            ``"broadcast"``, or a lookup's ``"row_fetch"`` and ``"row_reduce"`` (pairwise
            exchanges of the rows the indices name); ``"batch_size"`` is the small
            all-gather that checks a vmapped batch.
        unit: the unit it moves, or ``None`` when it belongs to no unit (a metric, a norm).
        numel: elements of the full (unsharded) buffer (0 for a row exchange, whose size
            follows the indices).
        dtype: the buffer's dtype.
        world: the size of the group it ran on.
    """

    op: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "broadcast"
    unit: str | None
    numel: int
    dtype: torch.dtype
    world: int

    @property
    def bytes(self) -> int:
        """Bytes of the full (unsharded) buffer: ``numel * dtype.itemsize``."""
        return self.numel * self.dtype.itemsize

    @property
    def ring_bytes(self) -> float:
        """Bytes a rank sends in the ring model: ``(W-1)/W`` of the full buffer (2x for all-reduce)."""
        factor = 2 if self.op == "all_reduce" else 1
        return factor * self.bytes * (self.world - 1) / self.world


@dataclass
class CommLog:
    """Collectives recorded while a ``comm_log()`` block is open, in issue order.

    Attributes:
        records: the ``Collective``s this rank issued, in issue order.
    """

    records: list[Collective] = field(default_factory=list)

    def of(self, op: str) -> list[Collective]:
        """The records of one kind of collective, in issue order.

        Args:
            op: a ``Collective.op``: ``"all_gather"``, ``"reduce_scatter"``, ...

        Returns:
            The records whose ``op`` is ``op`` (empty when none, or ``op`` is unknown).
        """
        return [c for c in self.records if c.op == op]

    def bytes(self, op: str | None = None) -> int:
        """Full-buffer bytes of the recorded collectives (``Collective.bytes`` summed).

        Args:
            op: only the collectives of this kind; ``None``: all of them.

        Returns:
            The sum of the records' ``bytes``.
        """
        return sum(c.bytes for c in self.records if op is None or c.op == op)

    def ring_bytes(self) -> float:
        """Bytes this rank sends over all recorded collectives, in the ring model.

        Returns:
            The sum of the records' ``ring_bytes``.
        """
        return sum(c.ring_bytes for c in self.records)


_logs = threading.local()


@contextlib.contextmanager
def comm_log() -> Iterator[CommLog]:
    """Record every collective fsdp_fn issues on this rank inside the block.

    Costs one list append per collective; communicates nothing. Blocks nest: each open
    log records. A group of one rank communicates nothing, so nothing is recorded for it.

    Yields:
        The ``CommLog`` the collectives are appended to, in issue order.

    Examples:
        >>> with comm_log() as log:
        ...     pass
        >>> log.records
        []
    """
    log = CommLog()
    stack = _logs.__dict__.setdefault("stack", [])
    stack.append(log)
    try:
        yield log
    finally:
        stack.remove(log)


def record(op: str, unit: str | None, numel: int, dtype: torch.dtype, group: dist.ProcessGroup) -> None:
    """Log a collective about to be issued (and, in check mode, agree on it with the other ranks)."""
    world = group.size()
    if world == 1:  # one rank communicates nothing
        return
    _guard.ensure_usable(group)
    guard = _guard.current()
    if guard is not None:
        guard.before(op, unit, numel, dtype, group)
    for log in _logs.__dict__.get("stack", ()):
        log.records.append(Collective(op, unit, numel, dtype, world))


# --- which comm a group uses: chosen once per group ------------------------------------------


def pairwise(group: dist.ProcessGroup) -> bool:
    """The rule the default choice follows: whether ``group`` runs all-gather and reduce-scatter
    as pairwise sends and receives (``PairwiseComm``): gloo, two ranks or more, unless the
    environment variable ``FSDP_FN_COLLECTIVES=native`` asks for gloo's own collectives
    (``bench/compare.py --collectives native``). Asked once per group, by ``comm_of``; NCCL
    and other backends use their own all-gather and reduce-scatter."""
    return str(dist.get_backend(group)) == "gloo" and group.size() > 1 and _transport() != "native"


_TRANSPORTS = ("shared", "sockets", "native")


def _transport() -> str:
    """What ``FSDP_FN_COLLECTIVES`` asks of a gloo group: ``shared`` (the default: shared memory
    between ranks of one host), ``sockets`` (gloo's own point-to-point messages) or ``native``
    (gloo's own all-gather and reduce-scatter)."""
    value = os.environ.get("FSDP_FN_COLLECTIVES") or "shared"
    if value not in _TRANSPORTS:
        raise ValueError(f"FSDP_FN_COLLECTIVES must be one of {', '.join(_TRANSPORTS)}, not {value!r}")
    return value


# group -> (its comm, whether set_comm gave it)
_chosen: dict[dist.ProcessGroup, tuple[Comm, bool]] = {}


def choose_again() -> None:
    """Forget every default choice (not the comms ``set_comm`` gave): each group chooses at its
    next collective, reading ``FSDP_FN_COLLECTIVES`` again."""
    for group in [g for g, (_, by_user) in _chosen.items() if not by_user]:
        del _chosen[group]


def comm_of(group: dist.ProcessGroup) -> Comm:
    """The ``Comm`` every collective fsdp_fn issues on ``group`` goes through.

    Chosen at the group's first use and kept (one dict lookup per call afterwards): the one
    ``set_comm`` gave the group, else on gloo with two ranks or more ``SharedMemoryComm`` on
    Linux x86-64 (its ranks connect at the first exchange, and keep gloo's sockets when they
    are not on one host or ``/dev/shm`` has no room for the rings), ``PairwiseComm`` elsewhere
    or with ``FSDP_FN_COLLECTIVES=sockets``, ``NativeComm`` with ``FSDP_FN_COLLECTIVES=native``;
    ``CudaComm`` on NCCL, ``NativeComm`` on other backends. Allocates nothing; communicates nothing.

    Args:
        group: the process group.

    Returns:
        The group's comm.

    Examples:
        >>> import torch.distributed as dist
        >>> comm = comm_of(dist.group.WORLD)  # one rank here: gloo's own collectives
        >>> type(comm).__name__, comm.pairwise, comm_of(dist.group.WORLD) is comm
        ('NativeComm', False, True)
    """
    chosen = _chosen.get(group)
    if chosen is not None:
        return chosen[0]
    comm: Comm
    if pairwise(group) and _transport() == "shared" and shared_memory_here():
        comm = SharedMemoryComm(group)
    else:
        comm = default_comm(group, pairwise(group))
    _chosen[group] = (comm, False)
    return comm


def set_comm(group: dist.ProcessGroup, comm: Comm | None) -> Comm | None:
    """Make ``comm`` carry every collective fsdp_fn issues on ``group`` from now on (FSDP2's
    ``set_custom_all_gather``): the unit all-gathers and their buffers, reduce-scatters,
    all-reduces, broadcasts, a lookup's row exchanges. ``None``: back to the default choice.

    Every rank of the group must set a comm that communicates alike. Call it between steps:
    a step made before keeps the lookups it chose (a non-``pairwise`` comm fetches no rows).
    fsdp_fn still logs each collective (``comm_log``) and runs the guard's checks before it
    calls the comm, and waits on what the comm returns. Allocates nothing; communicates nothing.

    Args:
        group: the process group (a ``Layout``'s ``group``).
        comm: a ``Comm`` over ``group`` (a subclass, or one that wraps ``comm_of(group)``), or ``None``.

    Returns:
        The comm the group used before, if one was chosen or set (``None`` otherwise).

    Raises:
        ValueError: if ``comm`` communicates over another group.
    """
    if comm is not None and comm.group is not group:
        raise ValueError(
            f"set_comm: the comm communicates over group {comm.group.group_name!r}, not {group.group_name!r}: "
            "make it over the group it is set for"
        )
    before = _chosen.pop(group, None)
    if comm is not None:
        _chosen[group] = (comm, True)
    return None if before is None else before[0]


# --- the raw collectives, on plain tensors -----------------------------------------------


def _describe(op: str, unit: str | None) -> Callable[[], str]:
    return functools.partial(_guard.describe, op, unit)


@phased("all_gather")
def all_gather_into(
    out: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    unit: str | None,
    *,
    async_op: bool = False,
    own: Sequence[tuple[int, int]] | None = None,
    op: str = "all_gather",
) -> Any:
    """``out`` (W * n) <- every rank's ``shard`` (n), in rank order, through the group's comm.
    ``async_op``: returns what to ``wait()`` on.

    ``own``: the ``[lo, hi)`` pieces of this rank's slot that must be filled from ``shard``
    (a comm may leave the rest of that slot as it is: the caller reads it from ``shard``); by
    default all of it. ``op``: its name in the log, the schedule check and errors. Memory:
    none beyond ``out``; communication: one all-gather."""
    record(op, unit, out.numel(), out.dtype, group)
    # A unit's buffer is gathered again for its backward, into tensors autograd saved in
    # forward: the same values, so the write must not count as an in-place change of them.
    with plain_mode(), torch.autograd.grad_mode._unsafe_preserve_version_counter(out):
        if group.size() == 1:
            out.copy_(shard)
            return None
        pending = comm_of(group).all_gather(out, shard, _describe(op, unit), own)
        if not async_op:
            pending.wait()
            return None
        return pending


def divides_first(dtype: torch.dtype) -> bool:
    """Whether a mean over ranks in ``dtype`` divides before it sums: float16 does (its range
    ends at 65504, so two ranks' gradients of 40000 sum to inf where their mean is finite:
    divided first, a mean whose parts are finite never overflows; FSDP2 splits the division
    around the sum); bfloat16 and float32, whose range is float32's, sum first (one rounding less)."""
    return dtype == torch.float16


@phased("reduce_scatter")
def reduce_scatter_start(
    full: torch.Tensor, group: dist.ProcessGroup, unit: str | None, scale: float = 1.0
) -> Callable[[], torch.Tensor]:
    """Issue a reduce-scatter through the group's comm without waiting; call the result to wait
    and get this rank's shard, times ``scale``.

    Memory: one shard (``PairwiseComm``: ``W-1`` received shards, one of which becomes the
    result); ``full`` stays alive until the result is taken; in float16 with a ``scale``, a
    scaled copy of ``full`` instead (``divides_first``). The sum comes out alike on every rank.
    """
    record("reduce_scatter", unit, full.numel(), full.dtype, group)
    with plain_mode():
        full = full.contiguous()
        if scale != 1.0 and group.size() > 1 and divides_first(full.dtype):
            full, scale = full * scale, 1.0
        if group.size() == 1:  # nothing to reduce: no copy either
            alone = full.view(-1) if scale == 1.0 else full * scale
            return lambda: alone
        taken = comm_of(group).reduce_scatter(full, _describe("reduce_scatter", unit))

        @phased("reduce_scatter")
        def finish() -> torch.Tensor:
            out = taken()
            with plain_mode():
                retag(out, "grads")
                return out.mul_(scale) if scale != 1.0 else out

        return finish


def reduce_scatter(full: torch.Tensor, group: dist.ProcessGroup, unit: str | None, scale: float = 1.0) -> torch.Tensor:
    """This rank's slice of ``scale * sum over ranks of full``; allocates one shard."""
    return reduce_scatter_start(full, group, unit, scale)()


def all_reduce_(tensor: torch.Tensor, group: dist.ProcessGroup, unit: str | None = None) -> torch.Tensor:
    """Sum ``tensor`` over ranks, in place, through the group's comm; waits."""
    record("all_reduce", unit, tensor.numel(), tensor.dtype, group)
    with torch._C._DisableFuncTorch():
        if group.size() > 1:
            comm_of(group).all_reduce(tensor, _describe("all_reduce", unit)).wait()
    return tensor


def all_reduce_over_(
    tensor: torch.Tensor, groups: Sequence[dist.ProcessGroup], unit: str | None = None
) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of every group in ``groups`` (a mesh's axes: over their
    product), in place: one all-reduce per group, in order."""
    for group in groups:
        all_reduce_(tensor, group, unit)
    return tensor


def all_reduce_start(
    tensor: torch.Tensor, group: dist.ProcessGroup, unit: str | None = None
) -> Callable[[], torch.Tensor]:
    """Issue a sum over ranks of a small ``tensor`` without waiting; call the result to wait and
    get the sum (a new tensor). On ``PairwiseComm`` it waits on nothing but the peers' messages,
    not on collectives queued before it (``Comm.all_reduce_apart``)."""
    record("all_reduce", unit, tensor.numel(), tensor.dtype, group)
    with plain_mode():
        if group.size() == 1:
            mine = tensor.clone()
            return lambda: mine
        return comm_of(group).all_reduce_apart(tensor, _describe("all_reduce", unit))


def broadcast_(tensor: torch.Tensor, group: dist.ProcessGroup, src: int = 0) -> torch.Tensor:
    """``tensor`` <- group rank ``src``'s ``tensor``, in place, through the group's comm; waits."""
    record("broadcast", None, tensor.numel(), tensor.dtype, group)
    if group.size() > 1:
        comm_of(group).broadcast(tensor, src, _describe("broadcast", None)).wait()
    return tensor


def _same_batch_size(size: int, group: dist.ProcessGroup, unit: str | None, op: str) -> None:
    """Under ``vmap``, before a batched collective: every rank's batch must be as large, since the
    collective sends the whole batch (a mismatch would make gloo abort the process). One small
    exchange; every rank raises alike if they differ."""
    if group.size() == 1:
        return
    sizes = torch.empty(group.size(), dtype=torch.int64)
    all_gather_into(sizes, torch.tensor([size], dtype=torch.int64), group, unit, op="batch_size")
    if bool((sizes != size).any()):
        by_rank = ", ".join(f"rank {r}: {int(b)}" for r, b in enumerate(sizes.tolist()))
        raise ValueError(
            f"vmap over a batch of different sizes on the ranks of group {group.group_name!r} ({by_rank}) at the "
            f"{_guard.describe(op, unit)}: a vmapped collective sends the whole batch, so every rank must vmap over as "
            "many elements (pad the smaller batches with zero-weight examples, as examples/research.py's "
            "dp_sgd_gradient does)"
        )


# --- the differentiable pair ------------------------------------------------------------


class _Linear(torch.autograd.Function):
    """The scaffolding of the four collectives below, each linear in its one tensor input
    ``(x, group, unit, scale)``: the context keeps ``group``, ``unit`` and ``scale``, and the
    tangent of the output is the same collective of the tangent. Each says its own forward,
    backward (its transpose) and vmap rule."""

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.group, ctx.unit, ctx.scale = inputs  # type: ignore[attr-defined]

    @classmethod
    def jvp(cls, ctx: Any, tangent: torch.Tensor, *_: None) -> torch.Tensor:  # type: ignore[override]
        return cast(torch.Tensor, cls.apply(tangent, ctx.group, ctx.unit, ctx.scale))


class _AllGather(_Linear):
    """``shard`` (n) -> every rank's shard in rank order (W * n). Its transpose is ``_ReduceScatter``.

    Every rule calls the pair's differentiable ``apply`` (never the raw collective), so the
    derivative of a derivative is still a collective the outer transform sees: grad of
    grad, jvp of grad, vmap of grad, jacrev, jacfwd and hessian compose.
    """

    @staticmethod
    def forward(shard: torch.Tensor, group: dist.ProcessGroup, unit: str | None, grad_scale: float) -> torch.Tensor:
        full = shard.new_empty(shard.numel() * group.size())
        all_gather_into(full, shard.contiguous(), group, unit)
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _GradReduceScatter.apply(grad, ctx.group, ctx.unit, ctx.scale), None, None, None

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        shard: torch.Tensor,
        group: dist.ProcessGroup,
        unit: str | None,
        grad_scale: float,
    ) -> tuple[torch.Tensor, int | None]:
        dim = in_dims[0]
        if dim is None:
            return _AllGather.apply(shard, group, unit, grad_scale), None
        # B shards of n -> one gather of the (B * n) buffer: (W, B, n) in rank order -> (B, W * n).
        batch = shard.movedim(dim, 0)
        size, n = batch.shape
        _same_batch_size(size, group, unit, "all_gather")
        full = _AllGather.apply(batch.reshape(-1), group, unit, grad_scale)
        return full.view(group.size(), size, n).transpose(0, 1).reshape(size, -1), 0


class _ReduceScatter(_Linear):
    """``full`` (W * n) -> ``scale *`` this rank's slice of the sum over ranks (n). Its transpose is ``_AllGather``."""

    @staticmethod
    def forward(full: torch.Tensor, group: dist.ProcessGroup, unit: str | None, scale: float) -> torch.Tensor:
        return reduce_scatter(full, group, unit, scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # d(scale * RS(x)) = scale * AG(g) = AG(scale * g); AG's own vjp is then scale * RS.
        scaled = grad * ctx.scale if ctx.scale != 1.0 else grad
        return _AllGather.apply(scaled, ctx.group, ctx.unit, ctx.scale), None, None, None

    @classmethod
    def vmap(  # type: ignore[override]
        cls,
        info: Any,
        in_dims: tuple[int | None, ...],
        full: torch.Tensor,
        group: dist.ProcessGroup,
        unit: str | None,
        scale: float,
    ) -> tuple[torch.Tensor, int | None]:
        dim = in_dims[0]
        if dim is None:
            return cls.apply(full, group, unit, scale), None
        # (B, W * n) -> (W, B, n): rank r's slots of every batch element are contiguous, so one
        # reduce-scatter of the (W * B * n) buffer leaves this rank (B, n).
        world = group.size()
        batch = full.movedim(dim, 0)
        size = batch.shape[0]
        _same_batch_size(size, group, unit, "reduce_scatter")
        n = batch.shape[1] // world
        ranked = batch.reshape(size, world, n).transpose(0, 1).reshape(-1)
        return cls.apply(ranked, group, unit, scale).view(size, n), 0


class _GradReduceScatter(_ReduceScatter):
    """The reduce-scatter an all-gather's backward makes: a gradient, averaged over the ranks.

    Its average is the seed's ``1/W`` (each rank's loss is one estimate of the mean loss),
    which every gather's backward applies. A gradient that is itself gathered again (a MAML
    inner step, ``s - lr * grad``, run by the outer loss) carries it already when the outer
    derivative reaches this node, and would take it a second time at the inner gather:
    ``regather`` marks such nodes, and their backward leaves the ``1/W`` out.
    """

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _Linear.setup_context(ctx, inputs, output)
        ctx.regathered = False  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scale = 1.0 if ctx.regathered else ctx.scale
        scaled = grad * scale if scale != 1.0 else grad
        return _AllGather.apply(scaled, ctx.group, ctx.unit, ctx.scale), None, None, None


def all_gather(
    shard: torch.Tensor, group: dist.ProcessGroup, *, unit: str | None = None, grad_scale: float = 1.0
) -> torch.Tensor:
    """Differentiable all-gather of 1-D ``shard`` into a new (W * n) tensor.

    Backward: ``grad_scale * reduce_scatter(grad)`` (``grad_scale=1/W`` averages over
    ranks, like DDP; a shard made from such a gradient is not averaged twice, see
    ``regather``); forward mode: the all-gather of the tangent; under ``vmap`` a
    (B, n) batch of shards is one all-gather of ``B * n`` elements per rank. Memory:
    allocates the gathered buffer; communication: one all-gather of ``W * n`` elements.

    Args:
        shard: this rank's 1-D shard (n elements); every rank's must be as long.
        group: the process group to gather over (W ranks).
        unit: the unit's name, for the collective log and error messages.
        grad_scale: what the backward's reduce-scatter multiplies by.

    Returns:
        Every rank's shard, concatenated in rank order (W * n elements).

    Raises:
        ValueError: under ``vmap``, if the ranks' batches differ in size (every rank
            raises alike).
        RankFailure: if a rank of ``group`` is known to be gone, or fails while this rank
            waits (under a train step's guard).
    """
    regather(shard)
    return cast(torch.Tensor, _AllGather.apply(shard, group, unit, grad_scale))


def reduce_scatter_sum(
    full: torch.Tensor, group: dist.ProcessGroup, *, unit: str | None = None, scale: float = 1.0
) -> torch.Tensor:
    """Differentiable ``scale * reduce_scatter(full)``: this rank's 1/W slice of the sum.

    Backward: ``scale * all_gather(grad)``; forward mode: ``scale * reduce_scatter`` of
    the tangent; under ``vmap`` one reduce-scatter of the whole batch. Memory: allocates
    one shard; communication: one reduce-scatter of ``full``.

    Args:
        full: a 1-D tensor of W * n elements, as long on every rank.
        group: the process group to reduce over (W ranks).
        unit: the unit's name, for the collective log and error messages.
        scale: what the sum is multiplied by (``1/W``: the mean over ranks).

    Returns:
        ``scale`` times the sum over ranks of this rank's slice of ``full`` (n elements).

    Raises:
        ValueError: if ``full``'s length does not divide by the group's size, or, under
            ``vmap``, if the ranks' batches differ in size.
        RankFailure: if a rank of ``group`` is known to be gone, or fails while this rank
            waits (under a train step's guard).
    """
    if full.numel() % group.size():
        raise ValueError(
            f"reduce_scatter needs a length divisible by the group size {group.size()}, got {full.numel()}"
        )
    return cast(torch.Tensor, _ReduceScatter.apply(full, group, unit, scale))


# --- replicas (hybrid sharding): the same value on every replica, and its transpose -------


class _Replicate(_Linear):
    """Identity forward on a value every rank of ``group`` holds alike (hybrid sharding's replicas),
    tied as one value: its backward is ``_AllReduce``, so each rank's gradient flows into it
    (summed, times ``grad_scale``), as DDP ties its replicas."""

    @staticmethod
    def forward(x: torch.Tensor, group: dist.ProcessGroup, unit: str | None, grad_scale: float) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _AllReduce.apply(grad, ctx.group, ctx.unit, ctx.scale), None, None, None

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        x: torch.Tensor,
        group: dist.ProcessGroup,
        unit: str | None,
        grad_scale: float,
    ) -> tuple[torch.Tensor, int | None]:
        return _Replicate.apply(x, group, unit, grad_scale), in_dims[0]


class _AllReduce(_Linear):
    """``scale *`` the sum over ranks (elementwise, any shape); self-adjoint, so its backward is itself."""

    @staticmethod
    def forward(x: torch.Tensor, group: dist.ProcessGroup, unit: str | None, scale: float) -> torch.Tensor:
        out = x.detach().clone(memory_format=torch.contiguous_format)
        if scale != 1.0 and divides_first(out.dtype):
            return all_reduce_(out.mul_(scale), group, unit)
        out = all_reduce_(out, group, unit)
        return out.mul_(scale) if scale != 1.0 else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # Every rank's output depends on every rank's input alike: the sum is its own transpose.
        return _AllReduce.apply(grad, ctx.group, ctx.unit, ctx.scale), None, None, None

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        x: torch.Tensor,
        group: dist.ProcessGroup,
        unit: str | None,
        scale: float,
    ) -> tuple[torch.Tensor, int | None]:
        if in_dims[0] is not None:
            _same_batch_size(x.shape[in_dims[0]], group, unit, "all_reduce")
        return _AllReduce.apply(x, group, unit, scale), in_dims[0]  # elementwise: one all-reduce of the batch


def regather(shard: torch.Tensor) -> None:
    """Mark the gradient reductions a shard about to be gathered was computed from.

    A shard made from a gradient (``s - lr * grad(loss)(s)``, MAML's inner step) is gathered
    again by a loss the outer derivative differentiates. That derivative's cotangent took the
    seed's average at this gather's backward; on its way back through the inner gradient's
    reductions it would take it again at the inner gather, so the meta-gradient's
    second-order term came out ``1/W`` too small. Marked reductions leave it out. Walks the
    shard's autograd graph at every ``torch.func`` level down to its leaves, not past a
    gradient's reduce-scatter; a leaf shard (every first-order call) costs nothing.
    """
    functorch = torch._C._functorch
    nodes = [shard.grad_fn]
    while functorch.is_functorch_wrapped_tensor(shard):  # each level's own history: an inner
        shard = functorch.get_unwrapped(shard)
        nodes.append(shard.grad_fn)  # grad's input is a leaf at its level, made from a gradient below
    stack = [node for node in nodes if node is not None]
    seen = {id(node): node for node in stack}
    while stack:
        node = stack.pop()
        if hasattr(node, "regathered"):  # an inner gradient's reduction: nothing below it is a gradient
            node.regathered = True
            continue
        for child, _ in node.next_functions:
            if child is not None and id(child) not in seen:
                seen[id(child)] = child
                stack.append(child)


def replicate(
    x: torch.Tensor, group: dist.ProcessGroup, *, unit: str | None = None, grad_scale: float = 1.0
) -> torch.Tensor:
    """``x`` itself, as a value that every rank of ``group`` holds alike (hybrid sharding's replicas).

    Backward: ``grad_scale *`` the all-reduce (sum) of the gradient over ``group``
    (``grad_scale=1/R`` averages over ``R`` replicas); forward mode: the tangent itself.
    Memory: none; communication: nothing forward, one all-reduce of ``x``'s size backward.
    """
    return cast(torch.Tensor, _Replicate.apply(x, group, unit, grad_scale))


def all_reduce_sum(
    x: torch.Tensor, group: dist.ProcessGroup, *, unit: str | None = None, scale: float = 1.0
) -> torch.Tensor:
    """Differentiable ``scale *`` the sum of ``x`` over the ranks of ``group`` (a new tensor).

    Backward: ``scale *`` the all-reduce of the gradient (every output depends on every
    input alike); forward mode: the all-reduce of the tangent; under ``vmap`` one
    all-reduce of the batch. Memory: one copy of ``x``; communication: one all-reduce.
    """
    return cast(torch.Tensor, _AllReduce.apply(x, group, unit, scale))
