"""Ranks on one host exchange through shared memory: ``SharedMemoryComm``.

gloo moves every point-to-point message through a TCP socket and a loop thread of its own;
on one host that costs more CPU per message than the copy it carries (``python
bench/transport.py``: 161-172 us of a process's CPU for a 100 KB exchange, against 35 us
through shared memory). Here every ordered pair of ranks has a ring of bytes in a file of
``/dev/shm``, mapped by both: the sender copies a message in, the receiver copies it out,
and a byte written to a named pipe (a bell) wakes a rank that waits for it. Messages on a
ring are matched in order, as gloo matches its sends and receives.

A send is copied into the ring when it is issued; what does not fit (the peer has not read
enough yet) leaves from a sender thread as the peer frees room, so no send waits for its
receiver. A receive is copied out by the thread that waits for it (after every receive
posted before it on that ring). Waiting blocks on the bell, never spins, and under a guard
keeps the guard's deadlines; a peer whose process is gone is named at once.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import platform
import select
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fsdp_fn import _guard
from fsdp_fn._comm import Describe, Exchanged, Pending, PairwiseComm

RING_BYTES = 4 << 20  # a ring's room (one per ordered pair of ranks): larger messages stream through it
_HEAD = 128  # the ring's two counters: bytes written (at 0) and bytes read (at 64), on cache lines of their own
_LIVENESS = 1.0  # seconds between looks at whether a peer's process is still there, while waiting


def same_host(group: dist.ProcessGroup) -> bool:
    """Whether shared memory can carry ``group``'s messages here: Linux on x86-64 (whose stores
    are seen in order by other cores, which the rings' counters rely on) with ``/dev/shm``.
    Whether the ranks share a host is agreed when a ``SharedMemoryComm`` is made."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor over its storage, with a version counter of its own:
    a receive copied into it later must not count as an in-place change of ``t`` (autograd may
    have saved views of a unit's buffer)."""
    if not t.is_contiguous():
        raise ValueError("SharedMemoryComm sends and receives contiguous tensors only")
    size = t.element_size()
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset() * size, (t.numel() * size,))


class _Message:
    """One message on a ring: its parts (an 8-byte header with the payload's size, then the
    payload), and how far it has been copied."""

    __slots__ = ("at", "done", "error", "parts", "part")

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts, self.part, self.at, self.done = parts, 0, 0, False
        self.error: str | None = None


class _Ring:
    """One direction between two ranks: ``cap`` bytes in a shared file, and two counters."""

    __slots__ = ("cap", "counters", "data", "lock", "mm", "peer", "queued", "posted")

    def __init__(self, path: str, cap: int, peer: int, create: bool) -> None:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, _HEAD + cap)
            self.mm = mmap.mmap(fd, _HEAD + cap)
        finally:
            os.close(fd)
        self.cap, self.peer = cap, peer
        self.counters = memoryview(self.mm)[:_HEAD].cast("q")  # [0]: written, [8]: read
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8, offset=_HEAD, count=cap)
        self.lock = threading.Lock()
        self.queued: collections.deque[_Message] = collections.deque()  # sends not yet all written
        self.posted: collections.deque[_Message] = collections.deque()  # receives not yet all read

    def put(self, src: torch.Tensor, at: int) -> int:
        """Copy as much of ``src[at:]`` as there is room for; the bytes copied."""
        c = self.counters
        written = c[0]
        n = min(self.cap - (written - c[8]), src.numel() - at)
        if n <= 0:
            return 0
        pos = written % self.cap
        first = min(n, self.cap - pos)
        self.data[pos : pos + first].copy_(src[at : at + first])
        if n > first:
            self.data[: n - first].copy_(src[at + first : at + n])
        c[0] = written + n  # after the bytes: x86-64 keeps the order of stores
        return n

    def take(self, dst: torch.Tensor, at: int) -> int:
        """Copy as much of ``dst[at:]`` as has arrived; the bytes copied."""
        c = self.counters
        read = c[8]
        n = min(c[0] - read, dst.numel() - at)
        if n <= 0:
            return 0
        pos = read % self.cap
        first = min(n, self.cap - pos)
        dst[at : at + first].copy_(self.data[pos : pos + first])
        if n > first:
            dst[at + first : at + n].copy_(self.data[: n - first])
        c[8] = read + n
        return n

    def send(self) -> bool:
        """Write queued sends, in order, as far as there is room; whether any bytes moved. Under ``lock``."""
        moved = False
        while self.queued:
            m = self.queued[0]
            while m.part < len(m.parts):
                part = m.parts[m.part]
                n = self.put(part, m.at)
                if n == 0:
                    return moved
                moved, m.at = True, m.at + n
                if m.at == part.numel():
                    m.part, m.at = m.part + 1, 0
            m.done = True
            self.queued.popleft()
        return moved

    def receive(self, upto: _Message) -> bool:
        """Read posted receives, in order, until ``upto`` is done or nothing more has arrived;
        whether any bytes moved. Under ``lock``."""
        moved = False
        while self.posted and not upto.done:
            m = self.posted[0]
            while m.part < len(m.parts):
                part = m.parts[m.part]
                n = self.take(part, m.at)
                if n == 0:
                    return moved
                moved, m.at = True, m.at + n
                if m.at == part.numel():
                    m.part, m.at = m.part + 1, 0
                    if m.part == 1:  # the header: the sender's size must be the size expected
                        sent, expected = int(part.view(torch.int64)), m.parts[1].numel()
                        if sent != expected:
                            m.error = f"rank {self.peer} sent {sent} bytes where {expected} were expected"
            m.done = True
            self.posted.popleft()
        return moved


def _bell(path: str) -> int:
    """A named pipe opened to read and write without blocking (open for both, it never blocks)."""
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)


def _ring_bell(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending already
        os.write(fd, b"\0")


def _hear(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        os.read(fd, 1 << 16)


class _Exchange:
    """What ``SharedMemoryComm.exchange`` returns to wait on (as ``_guard.Watched`` does):
    ``wait(timeout)`` copies its receives out as they arrive, blocking on the comm's bell in
    between; ``result()`` raises what went wrong (a peer gone, a size that does not match)."""

    __slots__ = ("comm", "done", "error", "receives", "sends", "works")

    def __init__(self, comm: SharedMemoryComm, sends: list[_Message], receives: list[tuple[_Ring, _Message]]) -> None:
        self.comm, self.sends, self.receives = comm, sends, receives
        self.works: tuple[Any, ...] = ()
        self.error: BaseException | None = None
        self.done = False
        guard = _guard.current()
        if guard is not None:  # (what a failure of the call leaves in flight: the next call settles it)
            guard.watched.append(self)  # type: ignore[arg-type]

    def _finished(self) -> bool:
        for ring, m in self.receives:
            if not m.done:
                with ring.lock:
                    if ring.receive(m):
                        _ring_bell(self.comm.peer_space[ring.peer])
                if not m.done:
                    return False
        if not all(m.done for m in self.sends):
            return False
        bad = [m.error for _, m in self.receives if m.error is not None]
        if bad:
            self.error = RuntimeError(f"SharedMemoryComm: {bad[0]} (the ranks issued different exchanges)")
        self.done = True
        return True

    def wait(self, timeout: float) -> bool:
        """Whether the exchange is done, waiting up to ``timeout`` seconds (below zero: as long
        as it takes, looking every second whether the peers' processes are still there)."""
        if self.done or self._finished():
            return True
        deadline = None if timeout < 0 else time.monotonic() + timeout
        bell = self.comm.bell
        while True:
            left = _LIVENESS if deadline is None else min(_LIVENESS, deadline - time.monotonic())
            if left > 0 and select.select([bell], [], [], left)[0]:
                _hear(bell)
            if self._finished():
                return True
            gone = self.comm.gone()
            if gone is not None:
                self.error, self.done = ConnectionError(gone), True
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def result(self) -> None:
        if self.error is not None:
            raise self.error


class SharedMemoryComm(PairwiseComm):
    """``PairwiseComm`` for ranks on one host: every point-to-point message through shared
    memory instead of gloo's sockets; all-reduces and broadcasts stay gloo's.

    Made on every rank of ``group`` at once (a collective: the ranks agree on their host and
    on the rings' files, then the files are unlinked, so nothing is left behind). Memory:
    ``ring_bytes`` of shared memory per ordered pair of ranks, ``2 (W-1) ring_bytes`` mapped
    per rank, outside torch's allocator; no copy beyond the ring. Communication: the same
    messages as ``PairwiseComm``; each one two copies and a bell, no thread of gloo's.

    Raises ``ValueError`` (on every rank) when the ranks are not all on one host.
    """

    def __init__(self, group: dist.ProcessGroup, ring_bytes: int = RING_BYTES) -> None:
        super().__init__(group)
        world, rank = group.size(), group.rank()
        base = f"/dev/shm/fsdp_fn-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        mine = [f"{base}-to{j}" for j in range(world)]
        made: list[str] = []
        try:
            for j in range(world):
                if j != rank:
                    made.append(mine[j])
            out = {j: _Ring(mine[j], ring_bytes, j, create=True) for j in range(world) if j != rank}
            for kind in ("bell", "space"):
                os.mkfifo(f"{base}-{kind}", 0o600)
                made.append(f"{base}-{kind}")
            self.bell, self.space = _bell(f"{base}-bell"), _bell(f"{base}-space")
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, (_host(), os.getpid(), base), group=group)
            hosts = {host for host, _, _ in everyone}
            if len(hosts) > 1:
                dist.barrier(group=group)
                raise ValueError(
                    f"SharedMemoryComm needs every rank of group {group.group_name!r} on one host; they are on "
                    + ", ".join(f"rank {r}: {h}" for r, (h, _, _) in enumerate(everyone))
                )
            self.pids = {j: pid for j, (_, pid, _) in enumerate(everyone) if j != rank}
            self.out = out
            self.into = {j: _Ring(f"{b}-to{rank}", ring_bytes, j, create=False) for j, (_, _, b) in enumerate(everyone) if j != rank}
            self.peer_bell = {j: _bell(f"{b}-bell") for j, (_, _, b) in enumerate(everyone) if j != rank}
            self.peer_space = {j: _bell(f"{b}-space") for j, (_, _, b) in enumerate(everyone) if j != rank}
            dist.barrier(group=group)  # every rank has opened its peers' files
        finally:
            for path in made:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self._looked = 0.0

    def gone(self) -> str | None:
        """Why a peer's messages will never come (its process is gone), or ``None``; looks at
        most once a second."""
        now = time.monotonic()
        if now - self._looked < _LIVENESS:
            return None
        self._looked = now
        for j, pid in self.pids.items():
            if not _alive(pid):
                return f"rank {j}'s process ({pid}) exited (Connection closed by peer)"
        return None

    def exchange(
        self, sends: Sequence[torch.Tensor | None], recvs: Sequence[torch.Tensor | None], what: Describe
    ) -> Pending:
        """``PairwiseComm.exchange`` through the rings: each receive posted on its peer's ring,
        each send copied into the ring to its peer (what does not fit: by the sender thread).
        Memory: none (``sends`` and ``recvs`` stay alive until it is waited on)."""
        receives: list[tuple[_Ring, _Message]] = []
        for j, into in enumerate(recvs):
            if into is not None:
                ring = self.into[j]
                m = _Message([torch.empty(8, dtype=torch.uint8), _bytes(into)])
                with ring.lock:
                    ring.posted.append(m)
                receives.append((ring, m))
        sent: list[_Message] = []
        for j, out in enumerate(sends):
            if out is not None:
                payload = _bytes(out)
                m = _Message([torch.tensor([payload.numel()], dtype=torch.int64).view(torch.uint8), payload])
                ring = self.out[j]
                with ring.lock:
                    ring.queued.append(m)
                    ring.send()
                _ring_bell(self.peer_bell[j])
                if not m.done:
                    _sender().hand(self, ring)
                sent.append(m)
        kept = tuple(t for t in (*sends, *recvs) if t is not None)
        return Exchanged([], what, kept, watched=_Exchange(self, sent, receives))


def _host() -> str:
    """This host, as the ranks compare it: its name and this boot's id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class _Sender:
    """The thread that writes what did not fit in a ring when it was sent, as the peer frees room."""

    def __init__(self) -> None:
        self.waiting: dict[int, tuple[SharedMemoryComm, _Ring]] = {}
        self.lock = threading.Lock()
        self.work = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="fsdp_fn-shm-send").start()

    def hand(self, comm: SharedMemoryComm, ring: _Ring) -> None:
        with self.lock:
            self.waiting[id(ring)] = (comm, ring)
        self.work.set()

    def _run(self) -> None:
        while True:
            self.work.wait()
            with self.lock:
                rings = list(self.waiting.values())
                self.work.clear()
            bells = set()
            for comm, ring in rings:
                with ring.lock:
                    moved = ring.send()
                    empty = not ring.queued
                if moved:
                    _ring_bell(comm.peer_bell[ring.peer])
                    _ring_bell(comm.bell)  # a send done: this rank may be waiting on it
                if empty:
                    with self.lock:
                        if not ring.queued:
                            self.waiting.pop(id(ring), None)
                else:
                    bells.add(comm.space)
            if bells:
                self.work.set()
                ready = select.select(list(bells), [], [], 0.05)[0]
                for fd in ready:
                    _hear(fd)


_the_sender: _Sender | None = None
_starting = threading.Lock()


def _sender() -> _Sender:
    global _the_sender
    with _starting:
        if _the_sender is None:
            _the_sender = _Sender()
        return _the_sender


def _forget_sender() -> None:
    global _the_sender, _starting
    _the_sender, _starting = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_sender)
