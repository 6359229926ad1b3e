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
would refuse).
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from fsdp_fn import _guard
from fsdp_fn._labels import label, retag
from fsdp_fn._phases import phased


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


# --- the raw collectives, on plain tensors -----------------------------------------------


def pairwise(group: dist.ProcessGroup) -> bool:
    """Whether to run all-gather and reduce-scatter as pairwise sends and receives.

    On gloo, measured on loopback with a 16 MB buffer (``python bench/collectives.py``,
    W=2 / W=4, ms): all_gather 18.1 / 24.8, as isend/irecv 6.4 / 13.2; reduce_scatter
    21.8 / 30.8 (gloo copies the buffer and runs a full all-reduce), as isend/irecv and
    a sum 10.7 / 16.6. Each rank still sends exactly ``(W-1)/W`` of the buffer. NCCL and
    other backends use their own all-gather and reduce-scatter; so does gloo with the
    environment variable ``FSDP_FN_COLLECTIVES=native`` (``bench/compare.py --collectives native``).
    """
    return _backend(group) == "gloo" and group.size() > 1 and os.environ.get("FSDP_FN_COLLECTIVES") != "native"


_backends: dict[str, str] = {}  # group name -> its backend (asked once: dist.get_backend looks through maps)


def _backend(group: dist.ProcessGroup) -> str:
    name = group.group_name
    backend = _backends.get(name)
    if backend is None:
        backend = _backends[name] = str(dist.get_backend(group))
    return backend


Describe = Callable[[], str]


class Pending:
    """Work handles issued together; ``wait()`` waits for all of them (through the active guard).

    Point-to-point works (``watch=True``) are handed to a waiter thread the moment they are
    issued (gloo cannot say whether they are done, nor stop a blocked wait); gloo's own
    collectives are polled; NCCL's are waited on directly (the wait orders streams only).
    ``what`` names the collective, built only when a message needs it."""

    def __init__(
        self,
        works: list[Any],
        what: Describe,
        keep: tuple[torch.Tensor, ...] = (),
        *,
        watch: bool = False,
        polled: bool = True,
    ) -> None:
        self.works, self.what = works, what
        self.keep = keep  # buffers the collective reads or writes: alive until it is done
        self.watched = _guard.watch(works) if watch and works else None
        self.polled = polled

    @phased("wait")
    def wait(self) -> None:
        if self.works:
            _guard.wait(self.works, self.what, self.watched, self.polled)
        self.works, self.keep, self.watched = [], (), None


def _native(group: dist.ProcessGroup, works: list[Any], what: Describe, keep: tuple[torch.Tensor, ...]) -> Pending:
    """The backend's own collective: polled on gloo, waited on directly elsewhere."""
    return Pending(works, what, keep, polled=_backend(group) == "gloo")


TAG = 0xF5D  # fsdp_fn's point-to-point messages: a user's own sends on the group (tag 0) never match them


def _exchange(
    group: dist.ProcessGroup, sends: list[torch.Tensor | None], recvs: list[torch.Tensor | None], what: Describe
) -> Pending:
    """Send ``sends[j]`` to group rank ``j`` and receive ``recvs[j]`` from it, for every other rank.

    The receives are posted here, and so are small sends; a large one leaves from this
    process's sender thread (``_send``). A waiter thread blocks on them all from now on."""
    works: list[Any] = []
    for j, into in enumerate(recvs):
        if into is not None:  # (the process group's own receive: dist.irecv's checks cost as much again)
            works.append(group.recv([into], j, TAG))
    works += [_send(out, group, j) for j, out in enumerate(sends) if out is not None]
    kept = tuple(t for t in (*sends, *recvs) if t is not None)
    return Pending(works, what, kept, watch=True)


SENDER_BYTES = 1 << 18  # a send at least this large leaves from the sender thread


def _send(tensor: torch.Tensor, group: dist.ProcessGroup, peer: int) -> Any:
    """Issue a send of ``tensor`` to group rank ``peer``, after every send issued before it.

    Why a sender thread for large sends: gloo writes a send's payload into the socket on the
    thread that issues it when the peer's receive is already posted, so the rank that arrived
    second would copy every payload on its step's thread while the first one waits; on the
    sender thread the copy runs beside the step, on a core that is otherwise idle (~2% of the
    bench GPT's step at W=2: ``python bench/alternate.py sender``). A small send costs less
    to copy than to hand over (``python bench/overhead.py``), so it is issued here, unless
    a queued send has not left yet (it would be overtaken: gloo matches messages in order)."""
    if tensor.numel() * tensor.element_size() < SENDER_BYTES and (_last is None or _last.issued.is_set()):
        return group.send([tensor], peer, TAG)
    return _QueuedSend(tensor, group, peer)


class _QueuedSend:
    """A send handed to the sender thread; ``wait()`` waits until it is issued, then until it is done."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup, peer: int) -> None:
        global _last
        self.tensor, self.group, self.peer = tensor, group, peer
        self.issued = threading.Event()
        self.work: Any = None
        self.error: BaseException | None = None
        _sender().put(self)
        _last = self

    def issue(self) -> None:
        try:
            self.work = self.group.send([self.tensor], self.peer, TAG)
        except BaseException as e:  # raised again by wait(), on the thread that waits
            self.error = e
        self.issued.set()

    def wait(self) -> None:
        self.issued.wait()
        if self.error is not None:
            raise self.error
        self.work.wait()


_sends: queue.SimpleQueue[_QueuedSend] | None = None
_last: _QueuedSend | None = None  # the send queued last: later sends go on the queue until it has left
_starting = threading.Lock()  # one sender thread per process, or sends could overtake each other


def _sender() -> queue.SimpleQueue[_QueuedSend]:
    """This process's queue of sends, served by one daemon thread (started at the first send)."""
    global _sends
    with _starting:
        if _sends is None:
            _sends = queue.SimpleQueue()
            threading.Thread(target=_send_all, args=(_sends,), daemon=True, name="fsdp_fn-send").start()
        return _sends


def _send_all(sends: queue.SimpleQueue[_QueuedSend]) -> None:
    while True:
        sends.get().issue()


def _forget_sender() -> None:
    global _sends, _starting, _last
    _sends, _starting, _last = None, threading.Lock(), None  # a forked child has no sender thread: it starts its own


os.register_at_fork(after_in_child=_forget_sender)


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
    """``out`` (W * n) <- every rank's ``shard`` (n), in rank order. ``async_op``: returns what to ``wait()`` on.

    ``own``: the ``[lo, hi)`` pieces of this rank's slot to fill from ``shard`` when the gather is
    pairwise (the rest of that slot is left as it is: the caller reads it from ``shard``); by
    default all of it. ``op``: its name in the log, the schedule check and errors."""
    world, rank = group.size(), group.rank()
    record(op, unit, out.numel(), out.dtype, group)
    what = functools.partial(_guard.describe, op, unit)
    # A unit's buffer is gathered again for its backward, into tensors autograd saved in
    # forward: the same values, so the write must not count as an in-place change of them.
    with torch._C._DisableFuncTorch(), torch.no_grad(), torch.autograd.grad_mode._unsafe_preserve_version_counter(out):
        if world == 1:
            out.copy_(shard)
            return None
        if pairwise(group):
            chunks = list(out.chunk(world))
            pending = _exchange(
                group,
                [None if j == rank else shard for j in range(world)],
                [None if j == rank else c for j, c in enumerate(chunks)],
                what,
            )
            mine = chunks[rank]
            for lo, hi in [(0, shard.numel())] if own is None else own:
                mine[lo:hi].copy_(shard[lo:hi])
        else:
            # Into an alias of ``out``'s storage with a version counter of its own: a backend's
            # collective counts its output as changed in place when it completes (on its own
            # thread, after the preserving block here), and a refill, the same values again, must
            # not look like a change to the views autograd saved ("a view created inside a custom
            # Function ... has been modified inplace"). Pairwise receives write unseen anyway.
            into = torch.empty(0, dtype=out.dtype, device=out.device).set_(
                out.untyped_storage(), out.storage_offset(), out.shape, out.stride()
            )
            pending = _native(
                group, [dist.all_gather_single(into, shard, group=group, async_op=True)], what, (into, shard)
            )
        if not async_op:
            pending.wait()
            return None
        return pending


@phased("reduce_scatter")
def reduce_scatter_start(
    full: torch.Tensor, group: dist.ProcessGroup, unit: str | None, scale: float = 1.0
) -> Callable[[], torch.Tensor]:
    """Issue a reduce-scatter without waiting; call the result to wait and get this rank's shard.

    Memory: (pairwise) ``W-1`` received shards, one of which becomes the result, so no
    shard more; ``full`` stays alive until the result is taken. The sum runs in rank order
    on every rank.
    """
    world, rank = group.size(), group.rank()
    record("reduce_scatter", unit, full.numel(), full.dtype, group)
    what = functools.partial(_guard.describe, "reduce_scatter", unit)
    with torch._C._DisableFuncTorch(), torch.no_grad():
        full = full.contiguous()
        if world == 1:  # nothing to reduce: no copy either
            alone = full.view(-1) if scale == 1.0 else full * scale
            return lambda: alone
        n = full.numel() // world
        if not pairwise(group):
            out = full.new_empty(n)
            work = _native(
                group, [dist.reduce_scatter_single(out, full, group=group, async_op=True)], what, (full, out)
            )

            def finish_native() -> torch.Tensor:
                work.wait()
                return out.mul_(scale) if scale != 1.0 else out

            return finish_native
        chunks = list(full.chunk(world))
        with label("comm"):  # one buffer per peer: the sum lands in one of them, the others go
            into: list[torch.Tensor | None] = [None if j == rank else full.new_empty(n) for j in range(world)]
        pending = _exchange(group, [None if j == rank else c for j, c in enumerate(chunks)], into, what)

        @phased("reduce_scatter")
        def finish() -> torch.Tensor:
            pending.wait()
            with torch._C._DisableFuncTorch(), torch.no_grad():
                parts = [chunks[rank] if t is None else t for t in into]  # in rank order: every rank sums alike
                into.clear()
                # The first sum goes into whichever of the two is a received buffer (a + b is b + a
                # exactly); the rest add on in rank order.
                first, second = parts[0], parts[1]
                out = second.add_(first) if rank == 0 else first.add_(second)
                for part in parts[2:]:
                    out.add_(part)
                del parts, first, second
                retag(out, "grads")
                return out.mul_(scale) if scale != 1.0 else out

        return finish


def reduce_scatter(full: torch.Tensor, group: dist.ProcessGroup, unit: str | None, scale: float = 1.0) -> torch.Tensor:
    """This rank's slice of ``scale * sum over ranks of full``; allocates one shard."""
    return reduce_scatter_start(full, group, unit, scale)()


def all_reduce_(tensor: torch.Tensor, group: dist.ProcessGroup, unit: str | None = None) -> torch.Tensor:
    """Sum ``tensor`` over ranks, in place."""
    record("all_reduce", unit, tensor.numel(), tensor.dtype, group)
    with torch._C._DisableFuncTorch():
        if group.size() > 1:
            work = dist.all_reduce(tensor, group=group, async_op=True)
            _native(group, [work], functools.partial(_guard.describe, "all_reduce", unit), ()).wait()
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
    get the sum (a new tensor). Pairwise: this rank's tensor goes to every peer and theirs are
    received (``W-1`` copies of it), so it waits on nothing but those peers' messages, not on
    collectives queued before it (a synchronous all-reduce here waited for the peer's next unit)."""
    record("all_reduce", unit, tensor.numel(), tensor.dtype, group)
    world, rank = group.size(), group.rank()
    what = functools.partial(_guard.describe, "all_reduce", unit)
    with torch._C._DisableFuncTorch(), torch.no_grad():
        mine = tensor.clone()
        if world == 1:
            return lambda: mine
        if not pairwise(group):
            work = _native(group, [dist.all_reduce(mine, group=group, async_op=True)], what, (mine,))

            def finish_native() -> torch.Tensor:
                work.wait()
                return mine

            return finish_native
        into = [None if j == rank else torch.empty_like(mine) for j in range(world)]
        pending = _exchange(group, [None if j == rank else mine for j in range(world)], into, what)

        def finish() -> torch.Tensor:
            pending.wait()
            parts = [mine if t is None else t for t in into]  # in rank order: every rank sums alike
            return torch.stack(parts).sum(0)

        return finish


def broadcast_(tensor: torch.Tensor, group: dist.ProcessGroup, src: int = 0) -> torch.Tensor:
    """``tensor`` <- group rank ``src``'s ``tensor``, in place."""
    record("broadcast", None, tensor.numel(), tensor.dtype, group)
    if group.size() > 1:
        work = dist.broadcast(tensor, group=group, group_src=src, async_op=True)
        _native(group, [work], lambda: "broadcast", (tensor,)).wait()
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
        return _ReduceScatter.apply(grad, ctx.group, ctx.unit, ctx.scale), None, None, None

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

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        full: torch.Tensor,
        group: dist.ProcessGroup,
        unit: str | None,
        scale: float,
    ) -> tuple[torch.Tensor, int | None]:
        dim = in_dims[0]
        if dim is None:
            return _ReduceScatter.apply(full, group, unit, scale), None
        # (B, W * n) -> (W, B, n): rank r's slots of every batch element are contiguous, so one
        # reduce-scatter of the (W * B * n) buffer leaves this rank (B, n).
        world = group.size()
        batch = full.movedim(dim, 0)
        size = batch.shape[0]
        _same_batch_size(size, group, unit, "reduce_scatter")
        n = batch.shape[1] // world
        ranked = batch.reshape(size, world, n).transpose(0, 1).reshape(-1)
        return _ReduceScatter.apply(ranked, group, unit, scale).view(size, n), 0


def all_gather(
    shard: torch.Tensor, group: dist.ProcessGroup, *, unit: str | None = None, grad_scale: float = 1.0
) -> torch.Tensor:
    """Differentiable all-gather of 1-D ``shard`` into a new (W * n) tensor.

    Backward: ``grad_scale * reduce_scatter(grad)`` (``grad_scale=1/W`` averages over
    ranks, like DDP); forward mode: the all-gather of the tangent; under ``vmap`` a
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
        out = all_reduce_(x.detach().clone(memory_format=torch.contiguous_format), group, unit)
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
