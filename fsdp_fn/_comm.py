"""How one process group communicates: one interface (``Comm``), one implementation per group.

The raw collectives under the differentiable pair (``_collectives.py``) and a lookup's row
exchanges all go through a ``Comm``: all-gather into a unit's buffer, reduce-scatter,
all-reduce, broadcast, the buffer a gather writes into, and what waiting on each takes (the
handle a collective returns carries its own wait). Which one a group uses is decided once,
when the group is first used (``_collectives.comm_of``), never inside a collective:

* ``PairwiseComm`` (gloo): all-gather and reduce-scatter as pairwise sends and receives, each
  waited on by a waiter thread (gloo cannot say whether a point-to-point work is done);
* ``NativeComm``: the backend's own collectives; on gloo polled, so the guard's timeouts
  still apply, elsewhere waited on directly;
* ``CudaComm`` (NCCL): the backend's own collectives on two CUDA streams of their own, one
  for all-gathers and one for reduce-scatters, ordered against the compute stream by events,
  as FSDP2's ``FSDPCommContext`` orders its streams.

A user may hand a group a ``Comm`` of their own (``fsdp_fn.set_comm``), as FSDP2's
``set_custom_all_gather`` does: any subclass that keeps each method's contract.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fsdp_fn import _guard
from fsdp_fn._function import plain_mode
from fsdp_fn._labels import label
from fsdp_fn._phases import phased

Describe = Callable[[], str]
"""Names the collective for a message; called only when a message needs it."""


# --- handles: what a collective returns, and the wait it needs ------------------------------------


class Pending:
    """Works issued together; ``wait()`` waits for all of them, as the works' kind needs.

    This base waits on each work directly: NCCL's, whose wait orders the device's streams
    and does not block the host. ``keep``: the tensors the works read or write, alive until
    they are done (dropped by ``wait``)."""

    __slots__ = ("keep", "what", "works")

    def __init__(self, works: list[Any], what: Describe, keep: tuple[torch.Tensor, ...] = ()) -> None:
        self.works, self.what, self.keep = works, what, keep

    @phased("wait")
    def wait(self) -> None:
        """Wait until the works are done (a ``RankFailure`` under a guard when a rank is gone)."""
        if self.works:
            self._wait()
        self.works, self.keep = [], ()

    def _wait(self) -> None:
        for w in self.works:
            w.wait()


class Polled(Pending):
    """Works the backend can say are done (gloo's own collectives): under a guard, polled for a
    moment on this thread, then watched by a waiter thread (``Guard.wait_polled``), so a rank
    that is gone is named instead of waited on forever."""

    __slots__ = ()

    def _wait(self) -> None:
        guard = _guard.current()
        if guard is not None:
            guard.wait_polled(self.works, self.what)
        else:
            super()._wait()


class Exchanged(Pending):
    """Point-to-point works, handed to a waiter thread the moment they are issued (gloo cannot
    say whether they are done, nor stop a blocked wait): waiting reads the waiter's flag, under
    a guard with its deadline (``Guard.wait_watched``)."""

    __slots__ = ("watched",)

    def __init__(
        self, works: list[Any], what: Describe, keep: tuple[torch.Tensor, ...] = (), watched: Any = None
    ) -> None:
        super().__init__(works, what, keep)
        if watched is None and works:
            watched = _guard.watch(works)
        self.watched = watched
        if watched is not None:
            self.works = [watched]  # (something to wait on: ``Pending.wait`` skips an empty list)

    def _wait(self) -> None:
        watched, self.watched = self.watched, None
        if watched is None:
            return
        guard = _guard.current()
        if guard is not None:
            guard.wait_watched(watched, self.what)
        else:
            watched.wait(timeout=-1)
            watched.result()


class Streamed(Pending):
    """A collective issued on a communication stream (``CudaComm``): waiting makes the stream
    current now (the compute stream) wait on the collective's event; the host never blocks."""

    __slots__ = ("event",)

    def __init__(self, event: Any, what: Describe, keep: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__([event], what, keep)
        self.event = event

    def _wait(self) -> None:
        torch.cuda.current_stream(self.keep[0].device if self.keep else None).wait_event(self.event)


# --- the interface --------------------------------------------------------------------------------


class Comm:
    """How one process group communicates: the raw collectives fsdp_fn issues on it.

    Every method works on plain 1-D tensors of the group's device, issues and returns at
    once, and hands back what to wait on; none records anything (fsdp_fn logs each
    collective and runs the guard's checks before it calls the comm). A group of one rank
    never reaches a comm's collectives. Subclass it to give a group one of your own
    (``fsdp_fn.set_comm``); the base class is the backend's own collectives
    (``NativeComm``'s behaviour, without the polling).

    Attributes:
        group: the process group it communicates over.
        pairwise: it exchanges point-to-point messages (``exchange``): a lookup unit may
            fetch only the rows it reads instead of gathering its table.
    """

    pairwise = False

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    # memory

    def buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new buffer for a unit's all-gather to write into (``numel`` elements): allocates
        it (labelled ``gathered`` in ``memory_trace``), on the stream current now."""
        with label("gathered"):
            return torch.empty(numel, dtype=dtype, device=device)

    def regrow(self, buffer: torch.Tensor) -> None:
        """Give a freed ``buffer`` its storage back, to be gathered into again: allocates its bytes."""
        buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())

    def free(self, buffer: torch.Tensor) -> None:
        """Release ``buffer``'s storage (views into it stay valid, their values gone until
        ``regrow``): frees its bytes. Called once every collective on it was waited on."""
        buffer.untyped_storage().resize_(0)

    # collectives

    def _issue(self, works: list[Any], what: Describe, keep: tuple[torch.Tensor, ...]) -> Pending:
        return Pending(works, what, keep)

    def all_gather(
        self, out: torch.Tensor, shard: torch.Tensor, what: Describe, own: Sequence[tuple[int, int]] | None = None
    ) -> Pending:
        """``out`` (W * n) <- every rank's ``shard`` (n), in rank order; once waited on.

        ``own``: the ``[lo, hi)`` pieces of this rank's slot the caller needs filled from
        ``shard``; the rest of that slot it reads from ``shard`` itself, so a comm may leave
        it as it is (``None``: all of it). Memory: none beyond ``out``. Communication: one
        all-gather, ``(W-1)/W`` of ``out`` sent per rank.
        """
        # Into an alias of ``out``'s storage with a version counter of its own: a backend's
        # collective counts its output as changed in place when it completes (on its own
        # thread, after the caller's version-preserving block), and a refill, the same values
        # again, must not look like a change to the views autograd saved ("a view created
        # inside a custom Function ... has been modified inplace").
        into = torch.empty(0, dtype=out.dtype, device=out.device).set_(
            out.untyped_storage(), out.storage_offset(), out.shape, out.stride()
        )
        work = dist.all_gather_single(into, shard, group=self.group, async_op=True)
        return self._issue([work], what, (into, shard))

    def reduce_scatter(self, full: torch.Tensor, what: Describe) -> Callable[[], torch.Tensor]:
        """Issue the sum over ranks of ``full`` (W * n), this rank's slice kept; call the result
        to wait and get it (n elements, a new tensor the caller may change in place).

        Memory: one shard; ``full`` stays alive until the result is taken. Communication:
        one reduce-scatter of ``full``. The sum must come out alike on every rank.
        """
        out = full.new_empty(full.numel() // self.group.size())
        work = self._issue([dist.reduce_scatter_single(out, full, group=self.group, async_op=True)], what, (full, out))

        def finish() -> torch.Tensor:
            work.wait()
            return out

        return finish

    def all_reduce(self, tensor: torch.Tensor, what: Describe) -> Pending:
        """``tensor`` <- its sum over ranks, in place, once waited on (any shape, contiguous).
        Memory: none; communication: one all-reduce."""
        return self._issue([dist.all_reduce(tensor, group=self.group, async_op=True)], what, (tensor,))

    def all_reduce_apart(self, tensor: torch.Tensor, what: Describe) -> Callable[[], torch.Tensor]:
        """Issue the sum over ranks of a small ``tensor`` (left as it is); call the result to wait
        and get the sum (a new tensor). A comm may make it wait on nothing queued before it.
        Memory: a copy of ``tensor`` (``PairwiseComm``: ``W-1`` more)."""
        mine = tensor.clone()
        work = self.all_reduce(mine, what)

        def finish() -> torch.Tensor:
            work.wait()
            return mine

        return finish

    def broadcast(self, tensor: torch.Tensor, src: int, what: Describe) -> Pending:
        """``tensor`` <- group rank ``src``'s ``tensor``, in place, once waited on."""
        work = dist.broadcast(tensor, group=self.group, group_src=src, async_op=True)
        return self._issue([work], what, (tensor,))

    def exchange(
        self, sends: Sequence[torch.Tensor | None], recvs: Sequence[torch.Tensor | None], what: Describe
    ) -> Pending:
        """Send ``sends[j]`` to group rank ``j`` and receive ``recvs[j]`` from it (``None``: nothing),
        for every other rank; only a ``pairwise`` comm has it."""
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point exchange (Comm.pairwise is False)")


class NativeComm(Comm):
    """The backend's own collectives, on the stream current now: polled on gloo (so the guard's
    timeouts still apply), waited on directly elsewhere (NCCL's wait orders streams only).
    On gloo, ``FSDP_FN_COLLECTIVES=native`` chooses it instead of ``PairwiseComm``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(group)
        self._polled = str(dist.get_backend(group)) == "gloo"

    def _issue(self, works: list[Any], what: Describe, keep: tuple[torch.Tensor, ...]) -> Pending:
        return Polled(works, what, keep) if self._polled else Pending(works, what, keep)


TAG = 0xF5D  # fsdp_fn's point-to-point messages: a user's own sends on the group (tag 0) never match them


class PairwiseComm(NativeComm):
    """gloo: all-gather and reduce-scatter as pairwise sends and receives; the rest gloo's own.

    Measured on loopback with a 16 MB buffer (``python bench/collectives.py``, W=2 / W=4,
    ms): all_gather 18.1 / 24.8, as isend/irecv 6.4 / 13.2; reduce_scatter 21.8 / 30.8 (gloo
    copies the buffer and runs a full all-reduce), as isend/irecv and a sum 10.7 / 16.6.
    Each rank still sends exactly ``(W-1)/W`` of the buffer. Every exchange is watched by a
    waiter thread from the moment it is issued (``Exchanged``). The default of a gloo group
    whose ranks are not on one host (on one host: ``SharedMemoryComm``), or with
    ``FSDP_FN_COLLECTIVES=sockets``; ``set_comm(group, PairwiseComm(group))`` on every rank
    chooses it for one group."""

    pairwise = True

    def exchange(
        self, sends: Sequence[torch.Tensor | None], recvs: Sequence[torch.Tensor | None], what: Describe
    ) -> Pending:
        """Send ``sends[j]`` to group rank ``j`` and receive ``recvs[j]`` from it, for every other rank.

        The receives are posted here, and so are small sends; a large one leaves from this
        process's sender thread (``_send``). A waiter thread blocks on them all from now on.
        Memory: none (``sends`` and ``recvs`` stay alive until it is waited on)."""
        group = self.group
        works: list[Any] = []
        try:
            for j, into in enumerate(recvs):
                if into is not None:  # (the process group's own receive: dist.irecv's checks cost as much again)
                    works.append(group.recv([into], j, TAG))
            works += [_send(out, group, j) for j, out in enumerate(sends) if out is not None]
        except RuntimeError as e:  # gloo: a peer's connection closed before this exchange was issued
            raise _guard.failed_to_issue(what, e) from e
        kept = tuple(t for t in (*sends, *recvs) if t is not None)
        return Exchanged(works, what, kept)

    def all_gather(
        self, out: torch.Tensor, shard: torch.Tensor, what: Describe, own: Sequence[tuple[int, int]] | None = None
    ) -> Pending:
        """``Comm.all_gather`` as ``W-1`` sends of ``shard`` and ``W-1`` receives straight into
        ``out``'s slots; only the ``own`` pieces of this rank's slot are copied from ``shard``."""
        world, rank = self.group.size(), self.group.rank()
        chunks = list(out.chunk(world))
        pending = self.exchange(
            [None if j == rank else shard for j in range(world)],
            [None if j == rank else c for j, c in enumerate(chunks)],
            what,
        )
        mine = chunks[rank]
        for lo, hi in [(0, shard.numel())] if own is None else own:
            mine[lo:hi].copy_(shard[lo:hi])
        return pending

    def reduce_scatter(self, full: torch.Tensor, what: Describe) -> Callable[[], torch.Tensor]:
        """``Comm.reduce_scatter`` as pairwise sends of each peer's slice and a sum in rank order
        on every rank. Memory: ``W-1`` received shards, one of which becomes the result, so no
        shard more."""
        world, rank = self.group.size(), self.group.rank()
        n = full.numel() // world
        chunks = list(full.chunk(world))
        with label("comm"):  # one buffer per peer: the sum lands in one of them, the others go
            into: list[torch.Tensor | None] = [None if j == rank else full.new_empty(n) for j in range(world)]
        pending = self.exchange([None if j == rank else c for j, c in enumerate(chunks)], into, what)

        def finish() -> torch.Tensor:
            pending.wait()
            with plain_mode():
                parts = [chunks[rank] if t is None else t for t in into]  # in rank order: every rank sums alike
                into.clear()
                # The first sum goes into whichever of the two is a received buffer (a + b is b + a
                # exactly); the rest add on in rank order.
                first, second = parts[0], parts[1]
                out = second.add_(first) if rank == 0 else first.add_(second)
                for part in parts[2:]:
                    out.add_(part)
                return out

        return finish

    def all_reduce_apart(self, tensor: torch.Tensor, what: Describe) -> Callable[[], torch.Tensor]:
        """``Comm.all_reduce_apart`` as this rank's tensor sent to every peer and theirs received
        (``W-1`` copies of it): it waits on nothing but those peers' messages, not on collectives
        queued before it (a synchronous all-reduce waited for the peer's next unit)."""
        world, rank = self.group.size(), self.group.rank()
        mine = tensor.clone()
        into = [None if j == rank else torch.empty_like(mine) for j in range(world)]
        pending = self.exchange([None if j == rank else mine for j in range(world)], into, what)

        def finish() -> torch.Tensor:
            pending.wait()
            parts = [mine if t is None else t for t in into]  # in rank order: every rank sums alike
            return torch.stack(parts).sum(0)

        return finish


class CudaComm(Comm):
    """NCCL: all-gathers on a CUDA stream of their own, reduce-scatters on another, ordered
    against the compute stream (the stream current when the collective is issued) by events.

    The discipline FSDP2 keeps: the all-gather stream waits on the compute stream before it
    writes (the shard and the buffer are ready, the buffer's last readers are done); the
    compute stream waits on the all-gather's event before it reads (``Pending.wait``, the
    host does not block); a tensor one stream allocated and another used is marked with
    ``record_stream``, so the caching allocator hands its memory out again only once that
    stream is done with it. So the next unit's all-gather overlaps this unit's compute, and
    a reduce-scatter the next unit's backward. All-reduces and broadcasts run on the compute
    stream (``Comm``'s)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(group)
        self._streams: dict[tuple[int | None, str], torch.cuda.Stream] = {}

    def stream(self, device: torch.device, kind: str) -> torch.cuda.Stream:
        """The comm's ``kind`` stream (``"all_gather"``, ``"reduce_scatter"``) on ``device``, made at first use."""
        key = (device.index, kind)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(device=device, priority=-1)
        return stream

    def all_gather(
        self, out: torch.Tensor, shard: torch.Tensor, what: Describe, own: Sequence[tuple[int, int]] | None = None
    ) -> Pending:
        """``Comm.all_gather`` on the all-gather stream; waiting orders the compute stream after it."""
        compute = torch.cuda.current_stream(out.device)
        stream = self.stream(out.device, "all_gather")
        stream.wait_stream(compute)  # the shard is written and the buffer free to be written
        into = torch.empty(0, dtype=out.dtype, device=out.device).set_(
            out.untyped_storage(), out.storage_offset(), out.shape, out.stride()
        )
        with torch.cuda.stream(stream):
            dist.all_gather_into_tensor(into, shard, group=self.group)
            event = stream.record_event()
        # Both belong to the compute stream: freed there, not reused until this stream is done.
        out.record_stream(stream)
        shard.record_stream(stream)
        return Streamed(event, what, (out, shard))

    def reduce_scatter(self, full: torch.Tensor, what: Describe) -> Callable[[], torch.Tensor]:
        """``Comm.reduce_scatter`` on the reduce-scatter stream, its shard allocated there; the
        result, once taken, is ready on the compute stream."""
        compute = torch.cuda.current_stream(full.device)
        stream = self.stream(full.device, "reduce_scatter")
        stream.wait_stream(compute)  # the full gradient is written
        with torch.cuda.stream(stream):
            out = full.new_empty(full.numel() // self.group.size())
            dist.reduce_scatter_tensor(out, full, group=self.group)
            event = stream.record_event()
        full.record_stream(stream)  # the caller frees it on the compute stream
        pending = Streamed(event, what, (out, full))

        def finish() -> torch.Tensor:
            pending.wait()
            out.record_stream(compute)  # allocated on the comm's stream, read and freed on the compute stream
            return out

        return finish


def default_comm(group: dist.ProcessGroup, pairwise: bool) -> Comm:
    """The comm fsdp_fn picks for ``group``: ``PairwiseComm`` when ``pairwise`` (gloo, two ranks
    or more), ``CudaComm`` on NCCL, ``NativeComm`` otherwise. Communicates nothing.

    Examples:
        >>> import torch.distributed as dist
        >>> type(default_comm(dist.group.WORLD, pairwise=True)).__name__
        'PairwiseComm'
        >>> type(default_comm(dist.group.WORLD, pairwise=False)).__name__  # gloo
        'NativeComm'
    """
    if pairwise:
        return PairwiseComm(group)
    if str(dist.get_backend(group)) == "nccl" and torch.cuda.is_available():
        return CudaComm(group)
    return NativeComm(group)


# --- the sender thread: large point-to-point sends leave beside the step ----------------------------


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
