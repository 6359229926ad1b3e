"""Ranks on one host exchange through shared memory: ``SharedMemoryComm``.

gloo moves every point-to-point message through a TCP socket and a loop thread of its own;
on one host that costs more CPU per message than the copy it carries (``python
bench/transport.py``: 161-172 us of a process's CPU for a 100 KB exchange, against 35 us
through shared memory). Here every ordered pair of ranks has a ring of bytes in a file of
``/dev/shm``, mapped by both: the sender copies a message in, the receiver copies it out,
and a byte written to a named pipe (a bell) wakes a rank that sleeps waiting for it (only
then: a flag in the ring says it sleeps). Messages on a ring are matched in order, as gloo
matches its sends and receives.

A send is copied into the ring when it is issued; what does not fit (the peer has not read
enough yet) leaves from a sender thread as the peer frees room, so no send waits for its
receiver. A receive is copied out by the thread that waits for it (after every receive
posted before it on that ring). Waiting blocks on the bell, never spins, and under a guard
keeps the guard's deadlines; a peer whose process is gone is named at once.
"""

from __future__ import annotations

import collections
import contextlib
import functools
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
from fsdp_fn._comm import Describe, Exchanged, PairwiseComm, Pending
from fsdp_fn._errors import RankFailure
from fsdp_fn._function import plain

RING_BYTES = 4 << 20  # a ring's room (one per ordered pair of ranks): larger messages stream through it
_HEAD = 128  # the ring's counters and flags: the sender's cache line (at 0), the receiver's (at 64)
# Words of a ring's head (``_Ring.counters``). A bell is rung only when its flag says someone
# sleeps on it. Each side writes its flag, then (through a lock's release, a full barrier on
# x86-64) reads the other's counter, and the other writes its counter, then reads the flag:
# one of the two always sees the other's write, so no wake-up is lost.
_WRITTEN, _ROOM_WANTED = 0, 1  # (the sender's) bytes written; its sender thread waits for room
_READ, _ASLEEP = 8, 9  # (the receiver's) bytes read; a thread of the receiver waits for bytes
_LIVENESS = 1.0  # seconds between looks at whether a peer's process is still there, while waiting
_CONNECT_TIMEOUT = 300.0  # seconds a rank waits for the others to connect, outside a guarded call


def shared_memory_here() -> bool:
    """Whether shared memory can carry messages on this machine: Linux on x86-64 (whose stores
    are seen in order by other cores, which the rings' counters rely on) with ``/dev/shm``.
    Whether a group's ranks share a host is agreed at its first exchange."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


# The rings and the messages' headers are no tensor memory of the step's: copies through
# them run with dispatch modes off, so a memory meter (``MemoryMeter``) sees none of them.
_quiet = torch._C._DisableTorchDispatch


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor over its storage, with a version counter of its own:
    a receive copied into it later must not count as an in-place change of ``t`` (autograd may
    have saved views of a unit's buffer)."""
    t = plain(t)  # (a tensor-parallel collective under torch.func)
    if not t.is_contiguous():
        raise ValueError("SharedMemoryComm sends and receives contiguous tensors only")
    size = t.element_size()
    out = torch.empty(0, dtype=torch.uint8)
    return out.set_(t.untyped_storage(), t.storage_offset() * size, (t.numel() * size,), (1,))


_HEADER = 64  # a message's header: its payload's size (one word), then what the sender was doing


def _label(what: Describe) -> bytes:
    """``what`` as a header carries it: its first ``_HEADER - 8`` bytes of UTF-8, padded with
    zeros; made once per operation and unit (``_guard.describe``'s arguments)."""
    key = what.args if isinstance(what, functools.partial) and what.func is _guard.describe else None
    label = _labels.get(key) if key is not None else None
    if label is None:
        label = what().encode()[: _HEADER - 8].ljust(_HEADER - 8, b"\0")
        if key is not None:
            _labels[key] = label
    return label


_labels: dict[Any, bytes] = {}


class _Message:
    """One message on a ring: a header of ``_HEADER`` bytes (the payload's size, and the
    sender's description of the exchange, read only when the size is not the one expected),
    then the payload, padded to a multiple of ``_HEADER`` bytes, so that every header is
    aligned and never wraps around the ring's end; and how far it has been copied."""

    __slots__ = ("at", "done", "error", "label", "padded", "payload", "size")

    def __init__(self, payload: torch.Tensor, label: bytes = b"") -> None:
        self.payload, self.size, self.label = payload, payload.numel(), label
        self.padded = (self.size + _HEADER - 1) & -_HEADER
        self.at = -1  # -1: the header is still to go; then the payload's bytes (and padding) moved
        self.done = False
        self.error: str | None = None


class _Ring:
    """One direction between two ranks: ``cap`` bytes in a shared file, two counters and two flags."""

    __slots__ = ("cap", "counters", "data", "lock", "mm", "peer", "posted", "queued", "raw", "sleepers", "words")

    def __init__(self, path: str, cap: int, peer: int, create: bool) -> None:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, _HEAD + cap)
            self.mm = mmap.mmap(fd, _HEAD + cap)
        finally:
            os.close(fd)
        self.cap, self.peer = cap, peer
        self.counters = memoryview(self.mm)[:_HEAD].cast("q")  # _WRITTEN, _ROOM_WANTED, _READ, _ASLEEP
        self.raw = memoryview(self.mm)[_HEAD:]  # the headers, at multiples of _HEADER
        self.words = self.raw.cast("q")
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8, offset=_HEAD, count=cap)
        self.lock = threading.Lock()
        self.queued: collections.deque[_Message] = collections.deque()  # sends not yet all written
        self.posted: collections.deque[_Message] = collections.deque()  # receives not yet all read
        self.sleepers = 0  # this process's threads asleep on bytes of this ring (under ``lock``)

    def sleep(self, asleep: bool) -> None:
        """Say (in ``_ASLEEP``) that a thread of this process sleeps on the ring's bytes, or no longer."""
        with self.lock:  # (its release: the barrier before the caller looks at the written counter)
            self.sleepers += 1 if asleep else -1
            self.counters[_ASLEEP] = int(self.sleepers > 0)

    def close(self) -> None:
        """Unmap the ring (its file is unlinked already: the memory goes with the last mapping)."""
        del self.data
        self.counters.release()
        self.words.release()
        self.raw.release()
        with contextlib.suppress(BufferError):
            self.mm.close()

    def put(self, m: _Message) -> int:
        """Copy as much of ``m``'s payload (from ``m.at``) as there is room for; the bytes
        the ring advanced (the padding after the payload included)."""
        c = self.counters
        written = c[_WRITTEN]
        n = min(self.cap - (written - c[_READ]), m.padded - m.at)
        if n <= 0:
            return 0
        real = min(n, m.size - m.at)
        if real > 0:
            pos = written % self.cap
            first = min(real, self.cap - pos)
            src, at = m.payload, m.at
            self.data[pos : pos + first].copy_(src[at : at + first])
            if real > first:
                self.data[: real - first].copy_(src[at + first : at + real])
        c[_WRITTEN] = written + n  # after the bytes: x86-64 keeps the order of stores
        return n

    def take(self, m: _Message) -> int:
        """Copy as much of ``m``'s payload (from ``m.at``) as has arrived; the bytes the ring
        advanced. Into a buffer whose storage was released meanwhile (a receive nobody waited
        for), nothing is copied: the bytes are read and dropped."""
        c = self.counters
        read = c[_READ]
        n = min(c[_WRITTEN] - read, m.padded - m.at)
        if n <= 0:
            return 0
        real = min(n, m.size - m.at)
        dst, at = m.payload, m.at
        if real > 0 and dst.untyped_storage().nbytes() >= dst.storage_offset() + dst.numel():
            pos = read % self.cap
            first = min(real, self.cap - pos)
            dst[at : at + first].copy_(self.data[pos : pos + first])
            if real > first:
                dst[at + first : at + real].copy_(self.data[: real - first])
        c[_READ] = read + n
        return n

    def send(self) -> bool:
        """Write queued sends, in order, as far as there is room; whether any bytes moved. Under ``lock``."""
        moved = False
        while self.queued:
            moved |= self._move(self.queued[0], incoming=False)
            if not self.queued[0].done:
                return moved
            self.queued.popleft()
        return moved

    def receive(self, upto: _Message) -> bool:
        """Read posted receives, in order, until ``upto`` is done or nothing more has arrived;
        whether any bytes moved. Under ``lock``."""
        moved = False
        while self.posted and not upto.done:
            moved |= self._move(self.posted[0], incoming=True)
            if not self.posted[0].done:
                return moved
            self.posted.popleft()
        return moved

    def _move(self, m: _Message, incoming: bool) -> bool:
        """Copy ``m`` on from where it stopped (out of the ring if ``incoming``, else into it),
        as far as it goes; whether any bytes moved. A received header whose size is not the
        receive's ends the message with an error (the ring is out of step from there)."""
        moved = False
        if m.at < 0:  # the header, aligned: it never wraps
            c = self.counters
            if incoming:
                read = c[_READ]
                if c[_WRITTEN] - read < _HEADER:
                    return False
                pos = read % self.cap
                sent = self.words[pos >> 3]
                if sent != m.size:  # (read before the counter below hands the header's room back)
                    theirs = bytes(self.raw[pos + 8 : pos + _HEADER]).rstrip(b"\0").decode(errors="replace")
                    m.error = f"rank {self.peer} sent {sent} bytes for the {theirs} where {m.size} were expected"
                c[_READ] = read + _HEADER
                if m.error is not None:
                    m.done = True
                    return True
            else:
                written = c[_WRITTEN]
                if self.cap - (written - c[_READ]) < _HEADER:
                    return False
                pos = written % self.cap
                self.words[pos >> 3] = m.size
                self.raw[pos + 8 : pos + _HEADER] = m.label
                c[_WRITTEN] = written + _HEADER
            m.at, moved = 0, True
        copy = self.take if incoming else self.put
        while m.at < m.padded:
            n = copy(m)
            if n == 0:
                return moved
            m.at += n
            moved = True
        m.done = True
        return moved


def _bell(path: str) -> int:
    """A named pipe opened to read and write without blocking (open for both, it never blocks)."""
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)


def _ring_bell(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending already
        os.write(fd, b"\0")


def _ready(fds: list[int], seconds: float) -> list[int]:
    """The bells among ``fds`` that rang, waiting up to ``seconds`` for one (``poll``: a process
    with many groups holds bells numbered past ``select``'s 1024)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(max(0, int(seconds * 1000)) or 1)]


def _hear(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        os.read(fd, 1 << 16)


class _Exchange:
    """What ``SharedMemoryComm.exchange`` returns to wait on (as ``_guard.Watched`` does):
    ``wait(timeout)`` copies its receives out as they arrive, blocking on the comm's bell in
    between; ``result()`` raises what went wrong (a peer gone, a size that does not match)."""

    __slots__ = ("done", "error", "link", "receives", "sends", "works")

    def __init__(self, link: _Link, sends: list[_Message], receives: list[tuple[_Ring, _Message]]) -> None:
        self.link, self.sends, self.receives = link, sends, receives
        self.works: tuple[Any, ...] = ()
        self.error: BaseException | None = None
        self.done = False
        guard = _guard.current()
        if guard is not None:  # (what a failure of the call leaves in flight: the next call settles it)
            guard.watched.append(self)  # type: ignore[arg-type]

    def _finished(self) -> bool:
        for ring, m in self.receives:
            if not m.done:
                with ring.lock, _quiet():
                    moved = ring.receive(m)
                if moved and ring.counters[_ROOM_WANTED]:  # (read after the lock's release)
                    _ring_bell(self.link.peer_space[ring.peer])
                if not m.done:
                    return False
        if not all(m.done for m in self.sends):
            return False
        bad = [m.error for _, m in self.receives if m.error is not None]
        if bad:
            self.error = RuntimeError(f"SharedMemoryComm: {bad[0]} (the ranks issued different exchanges)")
        self.sends, self.receives = [], []  # (the guard keeps the exchange to the end of its call: not the tensors)
        self.done = True
        return True

    def wait(self, timeout: float) -> bool:
        """Whether the exchange is done, waiting up to ``timeout`` seconds (below zero: as long
        as it takes, looking every second whether the peers' processes are still there)."""
        if self.done or self._finished():
            return True
        deadline = None if timeout < 0 else time.monotonic() + timeout
        bell = self.link.bell
        while True:
            left = _LIVENESS if deadline is None else min(_LIVENESS, deadline - time.monotonic())
            if left > 0:
                rings = [ring for ring, m in self.receives if not m.done]
                for ring in rings:  # (then look once more: bytes written before the flag rang no bell)
                    ring.sleep(True)
                try:
                    if not self._finished() and _ready([bell], left):
                        _hear(bell)
                finally:
                    for ring in rings:
                        ring.sleep(False)
            if self._finished():
                return True
            gone = self.link.gone()
            if gone is not None:
                self.error, self.done = RuntimeError(gone), True
                self.sends, self.receives = [], []
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def result(self) -> None:
        if self.error is not None:
            raise self.error


class SharedMemoryComm(PairwiseComm):
    """``PairwiseComm`` for ranks on one host: every point-to-point message through shared
    memory instead of gloo's sockets; all-reduces and broadcasts stay gloo's. The default of
    every gloo group of two ranks or more on Linux x86-64 (``comm_of``);
    ``FSDP_FN_COLLECTIVES=sockets`` keeps gloo's sockets (``PairwiseComm``) instead.

    The ranks connect at the group's first exchange, through the process group's store: they
    agree on their host and on the rings' files, then the files are unlinked (nothing is left
    behind, whatever happens to the processes). Ranks on different hosts keep gloo's sockets,
    and so do ranks of which one cannot make its rings (``/dev/shm`` without room for twice
    their size, or not writable) or open its peers'.
    Memory: ``ring_bytes`` of shared memory per ordered pair of ranks, ``2 (W-1) ring_bytes``
    mapped per rank (touched as messages pass), outside torch's allocator; no copy beyond the
    ring. Communication: the same messages as ``PairwiseComm``, each two copies and a bell.

    Examples:
        >>> import torch.distributed as dist
        >>> comm = SharedMemoryComm(dist.group.WORLD)  # made on every rank; connects at its first exchange
        >>> comm.pairwise, comm.ring_bytes, comm.link is None
        (True, 4194304, True)
        >>> SharedMemoryComm(dist.group.WORLD, ring_bytes=1000)
        Traceback (most recent call last):
        ValueError: ring_bytes must be a multiple of 64 of at least 4096, not 1000
    """

    def __init__(self, group: dist.ProcessGroup, ring_bytes: int = RING_BYTES) -> None:
        super().__init__(group)
        if ring_bytes < 4096 or ring_bytes % _HEADER:
            raise ValueError(f"ring_bytes must be a multiple of {_HEADER} of at least 4096, not {ring_bytes}")
        self.ring_bytes = ring_bytes

    @property
    def link(self) -> _Link | None:
        """The group's rings and bells (``None`` before its first exchange, or when its ranks are
        on different hosts): made once per group and ring size, shared by every comm of it, as
        gloo's sockets belong to the process group, not to a comm."""
        return _links.get((self.group.group_name, self.ring_bytes))

    def exchange(
        self, sends: Sequence[torch.Tensor | None], recvs: Sequence[torch.Tensor | None], what: Describe
    ) -> Pending:
        """``PairwiseComm.exchange`` through the rings: each receive posted on its peer's ring,
        each send copied into the ring to its peer (what does not fit: by the sender thread).
        Memory: none (``sends`` and ``recvs`` stay alive until it is waited on). The group's
        first one connects its ranks (a few round trips through the store)."""
        key = (self.group.group_name, self.ring_bytes)
        link = _links.get(key)
        if link is None:
            if key not in _links:
                _close_gone()
                _links[key] = _connect(self.group, self.ring_bytes, what)
            link = _links[key]
            if link is None:  # on different hosts
                return super().exchange(sends, recvs, what)
        with _quiet():
            return self._exchange(link, sends, recvs, what)

    def _exchange(
        self, link: _Link, sends: Sequence[torch.Tensor | None], recvs: Sequence[torch.Tensor | None], what: Describe
    ) -> Pending:
        receives: list[tuple[_Ring, _Message]] = []
        for j, into in enumerate(recvs):
            if into is not None:
                ring = link.into[j]
                m = _Message(_bytes(into))
                with ring.lock:
                    ring.posted.append(m)
                receives.append((ring, m))
        sent: list[_Message] = []
        for j, out in enumerate(sends):
            if out is not None:
                m = _Message(_bytes(out), _label(what))
                ring = link.out[j]
                with ring.lock:
                    ring.queued.append(m)
                    ring.send()
                if ring.counters[_ASLEEP]:  # (read after the lock's release)
                    _ring_bell(link.peer_bell[j])
                if not m.done:
                    _sender().hand(link, ring)
                sent.append(m)
        kept = tuple(t for t in (*sends, *recvs) if t is not None)
        return Exchanged([], what, kept, watched=_Exchange(link, sent, receives))


class _Link:
    """This rank's side of the rings and bells of one group: what ``_connect`` set up."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.out: dict[int, _Ring] = {}
        self.into: dict[int, _Ring] = {}
        self.peer_bell: dict[int, int] = {}
        self.peer_space: dict[int, int] = {}
        self.pids: dict[int, int] = {}
        self.bell = self.space = -1
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

    def close(self) -> None:
        for ring in (*self.out.values(), *self.into.values()):
            ring.close()
        for fd in (self.bell, self.space, *self.peer_bell.values(), *self.peer_space.values()):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.out, self.into, self.peer_bell, self.peer_space = {}, {}, {}, {}
        self.bell = self.space = -1


# (group name, ring bytes) -> the group's link; None: its ranks are on different hosts
_links: dict[tuple[str, int], _Link | None] = {}
_connections: dict[str, int] = {}  # group name -> the links made for it so far (the store's keys)


def _close_gone() -> None:
    """Close the links of groups destroyed since (their shared memory goes with them)."""
    live = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
    for key, link in list(_links.items()):
        if link is not None and link.group not in live:
            del _links[key]
            link.close()


def _connect(group: dist.ProcessGroup, ring_bytes: int, what: Describe) -> _Link | None:
    """Set up this rank's rings and bells with every other rank of ``group`` through the
    store: ``None`` (on every rank) when the ranks are not all on one host, or one of them
    cannot make its rings or open its peers' (then they keep gloo's sockets). Waits for the
    others within the guard's timeout (else ``_CONNECT_TIMEOUT``), naming the ranks that did
    not come (``RankFailure``). Leaves no file behind."""
    store = _guard._store()
    if store is None:
        return None
    world, rank = group.size(), group.rank()
    name = group.group_name
    count = _connections.get(name, 0) + 1  # (a name is used again once its group is destroyed)
    key = f"fsdp_fn/shm/{name}/{ring_bytes}/{count}"
    guard = _guard.current()
    deadline = time.monotonic() + (guard.timeout if guard is not None else _CONNECT_TIMEOUT)
    base = f"/dev/shm/fsdp_fn-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    made = [f"{base}-to{j}" for j in range(world) if j != rank] + [f"{base}-bell", f"{base}-space"]
    link = _Link(group)
    try:
        # A rank that cannot make its rings (no room in /dev/shm, no permission) says so in place
        # of its host: then every rank keeps the sockets, as on different hosts.
        host = _host()
        try:
            if not _room_for((world - 1) * (_HEAD + ring_bytes)):
                raise OSError(f"/dev/shm has no room for {world - 1} rings of {ring_bytes} bytes")
            link.out = {j: _Ring(f"{base}-to{j}", ring_bytes, j, create=True) for j in range(world) if j != rank}
            for kind in ("bell", "space"):
                os.mkfifo(f"{base}-{kind}", 0o600)
            link.bell, link.space = _bell(f"{base}-bell"), _bell(f"{base}-space")
        except OSError:
            host = ""
        store.set(f"{key}/{rank}", f"{host}\n{os.getpid()}\n{base}")
        peers = [j for j in range(world) if j != rank]
        _wait_for(store, [f"{key}/{j}" for j in peers], peers, deadline, group, what, "to connect")
        everyone = {j: store.get(f"{key}/{j}").decode().split("\n") for j in peers}
        if not host or any(theirs != host for theirs, _, _ in everyone.values()):
            link.close()
            return None
        # A rank that cannot open its peers' files (a /dev/shm of its own that the host check
        # did not tell apart) says so: then every rank keeps the sockets.
        attached = "1"
        try:
            for j, (_, pid, theirs) in everyone.items():
                link.pids[j] = int(pid)
                link.into[j] = _Ring(f"{theirs}-to{rank}", ring_bytes, j, create=False)
                link.peer_bell[j] = _bell(f"{theirs}-bell")
                link.peer_space[j] = _bell(f"{theirs}-space")
        except OSError:
            attached = "0"
        store.set(f"{key}/{rank}/attached", attached)
        _wait_for(store, [f"{key}/{j}/attached" for j in peers], peers, deadline, group, what, "to open the rings")
        if attached == "0" or any(store.get(f"{key}/{j}/attached") != b"1" for j in peers):
            link.close()
            return None
    except BaseException as e:
        link.close()
        # The ranks that did connect would wait for this one forever: the group is out of step.
        _guard._lost(group, [], f"its ranks did not all connect through shared memory ({type(e).__name__}: {e})")
        raise
    finally:
        for path in made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    _connections[name] = count
    return link


def _wait_for(
    store: Any, keys: list[str], ranks: list[int], deadline: float, group: dist.ProcessGroup, what: Describe, doing: str
) -> None:
    nap = 0.0005
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
            raise RankFailure(
                f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of group "
                f"{group.group_name!r} did not come {doing} through shared memory before the {what()}"
            )
        guard = _guard.current()
        if guard is not None:
            remote = guard._remote_error()
            if remote is not None:
                raise RankFailure(f"{remote}; rank {group.rank()} stopped waiting {doing} before the {what()}")
        time.sleep(nap)
        nap = min(2 * nap, 0.01)


def _room_for(nbytes: int) -> bool:
    """Whether ``/dev/shm`` has room for ``nbytes`` more, twice over (its pages are taken as
    messages pass: a ring that outgrew a full ``/dev/shm`` would end the process)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= 2 * nbytes


def _host() -> str:
    """This host, as the ranks compare it: its name, this boot's id, and which ``/dev/shm``
    this process sees (containers on one host may each mount their own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        shm = os.stat("/dev/shm")
    except OSError:
        return ""
    return f"{socket.gethostname()}/{boot}/{shm.st_dev}:{shm.st_ino}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class _Sender:
    """The thread that writes what did not fit in a ring when it was sent, as the peer frees room."""

    def __init__(self) -> None:
        self.waiting: dict[int, tuple[_Link, _Ring]] = {}
        self.lock = threading.Lock()
        self.work = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="fsdp_fn-shm-send").start()

    def hand(self, link: _Link, ring: _Ring) -> None:
        with self.lock:
            self.waiting[id(ring)] = (link, ring)
        self.work.set()

    def _run(self) -> None:
        while True:
            self.work.wait()
            with self.lock:
                rings = list(self.waiting.values())
                self.work.clear()
            bells = set()
            for link, ring in rings:
                with ring.lock:  # (its release: the barrier before looking for room)
                    ring.counters[_ROOM_WANTED] = 1
                with ring.lock, _quiet():
                    moved = ring.send()
                    empty = not ring.queued
                    if empty:
                        ring.counters[_ROOM_WANTED] = 0
                if moved:
                    if ring.counters[_ASLEEP]:
                        _ring_bell(link.peer_bell[ring.peer])
                    _ring_bell(link.bell)  # a send done: this rank may be waiting on it
                if empty:
                    with self.lock:
                        if not ring.queued:
                            self.waiting.pop(id(ring), None)
                else:
                    bells.add(link.space)
            if bells:
                self.work.set()
                for fd in _ready(list(bells), 0.05):
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
    """A forked child has no sender thread, and must not use its parent's rings: it connects anew."""
    global _the_sender, _starting
    _the_sender, _starting = None, threading.Lock()
    _links.clear()


os.register_at_fork(after_in_child=_forget_sender)
