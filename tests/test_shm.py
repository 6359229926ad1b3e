"""Ranks on one host exchange through shared memory (``SharedMemoryComm``): the same values as
gloo's sockets, messages larger than a ring streamed through it, many in flight, a size that
does not match and a peer that is gone named, ranks on different hosts kept on the sockets, and
no file left in ``/dev/shm``."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import fsdp_fn as ff
from fsdp_fn import _comm, _guard, _shm

pytestmark = pytest.mark.skipif(not _shm.shared_memory_here(), reason="shared memory rings need Linux x86-64")


def _what() -> str:
    return "exchange under test"


def _gathered_and_reduced(comm, group, sizes, dtype):
    """All-gathers and reduce-scatters of every size in ``sizes``, all issued before any is waited on."""
    world, rank = group.size(), group.rank()
    gathers, reduces = [], []
    for k, n in enumerate(sizes):
        shard = (torch.arange(n, dtype=torch.float64) * (rank + 1) + k).to(dtype)
        out = torch.empty(world * n, dtype=dtype)
        gathers.append((out, comm.all_gather(out, shard, _what)))
        full = (torch.arange(world * n, dtype=torch.float64) * (rank + 2) - k).to(dtype)
        reduces.append(comm.reduce_scatter(full, _what))
    for _, pending in gathers:
        pending.wait()
    return [out for out, _ in gathers], [finish() for finish in reduces]


def _both_ways(group, ring_bytes):
    sizes = [1, 7, 0, 1000, 40_000, 3]  # 160 KB a message at the largest: forty rings of 4 KB; none at all
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        got = _gathered_and_reduced(_shm.SharedMemoryComm(group, ring_bytes=ring_bytes), group, sizes, dtype)
        want = _gathered_and_reduced(_comm.PairwiseComm(group), group, sizes, dtype)
        out[str(dtype)] = all(torch.equal(a, b) for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True))
    left = [f for f in os.listdir("/dev/shm") if f.startswith(f"fsdp_fn-{os.getpid()}-")]
    return out, left


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("ring_bytes", [4096, _shm.RING_BYTES])
def test_shared_memory_delivers_what_gloos_sockets_deliver(pool, world, ring_bytes):
    # Catches: a message cut or wrapped wrongly at the ring's end, an empty one never done, a send that never leaves
    # once the ring is full (4 KB rings: every large message streams through the sender
    # thread), messages matched out of order with many in flight, a dtype's bytes miscounted,
    # a sum that differs from the sockets' by a rounding, a ring file left behind.
    for same, left in pool.run(_both_ways, ring_bytes, world=world):
        assert same == {"torch.float32": True, "torch.bfloat16": True, "torch.float64": True}
        assert left == []


# Rings of their own (a ring size no other test uses): these tests leave theirs out of step.
MISMATCHED, GONE = 4096 + 64, 4096 + 128


def _mismatched(group):
    rank = group.rank()
    comm = _shm.SharedMemoryComm(group, ring_bytes=MISMATCHED)
    peer = 1 - rank
    sends: list = [None, None]
    recvs: list = [None, None]
    sends[peer] = torch.ones(10 if rank == 0 else 12)
    recvs[peer] = torch.empty(10 if rank == 0 else 12)
    unit = f"blocks.{rank}"  # (what each rank was doing: the other names it)
    try:
        comm.exchange(sends, recvs, functools.partial(_guard.describe, "all_gather", unit)).wait()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_message_of_another_size_is_named(pool):
    # Catches: a receive that reads the peer's message into a buffer of another size (values
    # silently shifted: every later message read from the wrong place), an error that does not
    # say what the sender was doing (the unit where the ranks parted).
    messages = pool.run(_mismatched, world=2)
    assert "rank 1 sent 48 bytes for the all-gather of unit 'blocks.1' where 40 were expected" in messages[0]
    assert "rank 0 sent 40 bytes for the all-gather of unit 'blocks.0' where 48 were expected" in messages[1]


def _peer_gone(group):
    rank = group.rank()
    comm = _shm.SharedMemoryComm(group, ring_bytes=GONE)
    peer = [None, None]
    peer[1 - rank] = torch.ones(1)
    comm.exchange(peer, [t if t is None else torch.empty(1) for t in peer], _what).wait()  # connected
    if rank == 1:
        return "sent"
    link = comm.link
    assert link is not None
    # The peer's process "exits": its pid is now one that is gone.
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    alive, link.pids[1] = link.pids[1], int(done.stdout)
    try:
        comm.exchange([None, None], [None, torch.empty(4)], _what).wait()  # never sent
    except RuntimeError as e:
        return str(e)
    finally:
        link.pids[1] = alive
    return "no error"


def test_a_peer_whose_process_is_gone_is_named(pool):
    # Catches: a wait on shared memory that hangs forever when the peer died (gloo's sockets
    # break; a ring just stays empty).
    mine, _ = pool.run(_peer_gone, world=2)
    assert "rank 1's process" in mine and "exited" in mine


def _kept_apart(group, why):
    """An all-gather over shared memory where ``why`` is "hosts" (each rank on a host of its
    own), "room" (the last rank's /dev/shm without room for its rings), "open" (the last rank
    cannot open its peers' rings: a /dev/shm of its own) or None."""
    rank = group.rank()
    real_host, real_room, real_ring = _shm._host, _shm._room_for, _shm._Ring
    last = rank == group.size() - 1
    if why == "hosts":
        _shm._host = lambda: f"host-{rank}"
    if why == "room" and last:
        _shm._room_for = lambda nbytes: False
    if why == "open" and last:

        def ring(path, cap, peer, create):
            if not create:
                raise FileNotFoundError(path)
            return real_ring(path, cap, peer, create)

        _shm._Ring = ring
    try:
        sizes = {None: 0, "hosts": 1, "room": 2, "open": 3}  # (a link of its own each time)
        comm = _shm.SharedMemoryComm(group, ring_bytes=4096 + 192 + 64 * sizes[why])
        out = torch.empty(2 * group.size())
        comm.all_gather(out, torch.full((2,), float(rank)), _what).wait()
        return comm.link is None, out.tolist()
    finally:
        _shm._host, _shm._room_for, _shm._Ring = real_host, real_room, real_ring


@pytest.mark.parametrize("why", ["hosts", "room", "open", None])
def test_ranks_on_different_hosts_or_without_room_keep_gloos_sockets(pool, why):
    # Catches: rings set up between ranks that cannot share memory (each would read a file of
    # its own host), rings in a /dev/shm too full for them (a SIGBUS when a page is touched), a
    # rank that cannot open its peers' rings failing the group instead of keeping the sockets,
    # or a choice that differs between ranks (a hang).
    for sockets, values in pool.run(_kept_apart, why, world=3):
        assert (sockets, values) == (why is not None, [0.0, 0.0, 1.0, 1.0, 2.0, 2.0])


def test_room_is_asked_of_dev_shm_and_the_host_names_its_mount():
    # Catches: a check that always says yes (or no) whatever /dev/shm holds; a host that two
    # containers with a /dev/shm each would share.
    free = os.statvfs("/dev/shm")
    assert _shm._room_for(1) and not _shm._room_for(free.f_blocks * free.f_frsize)
    mount = os.stat("/dev/shm")
    assert _shm._host().endswith(f"/{mount.st_dev}:{mount.st_ino}")


def _chosen(group):
    from tests.helpers import collectives

    saved = ff.set_comm(group, None)  # the default choice, whatever an earlier test set
    kinds = []
    try:
        for value in ("", "shared", "sockets", "native"):
            with collectives(value):
                kinds.append(type(ff.comm_of(group)).__name__)
        with collectives("pairwise"):
            try:
                ff.comm_of(group)
            except ValueError as e:
                kinds.append(str(e))
    finally:
        ff.set_comm(group, saved)
    return kinds


def test_shared_memory_is_the_default_and_the_environment_chooses(pool):
    # Catches: shared memory not the default on one host, FSDP_FN_COLLECTIVES not reaching the
    # choice, a choice that cannot go back, a misspelt value taken silently for the default.
    kinds = ["SharedMemoryComm", "SharedMemoryComm", "PairwiseComm", "NativeComm"]
    kinds.append("FSDP_FN_COLLECTIVES must be one of shared, sockets, native, not 'pairwise'")
    assert pool.run(_chosen, world=2)[0] == kinds


def _train(group, sockets, steps=3):
    from examples.gpt import GPTConfig
    from tests.helpers import gpt_state, local_part, rows_fetched

    cfg = GPTConfig(vocab=50, seq=8, d_model=12, n_layers=3, n_heads=2)
    world, rank = group.size(), group.rank()
    saved = ff.set_comm(group, _comm.PairwiseComm(group) if sockets else _shm.SharedMemoryComm(group))
    try:
        with rows_fetched():  # the lookups fetch their rows: exchanges of their own
            _, step, state = gpt_state(group, cfg, split_root=True)
            losses = []
            for k in range(steps):
                g = torch.Generator().manual_seed(k)
                batch = local_part(torch.randint(0, cfg.vocab, (2 * world + 1, cfg.seq + 1), generator=g), rank, world)
                state, metrics = step(state, batch)
                losses.append(float(metrics["loss"]))
    finally:
        ff.set_comm(group, saved)
    return losses, ff.unshard(state.params)


@pytest.mark.parametrize("world", [2, 3])
def test_a_train_step_through_shared_memory_equals_one_through_the_sockets(pool, world):
    # Catches: a step whose gathers, reduce-scatters or row exchanges come out different (by
    # a bit) through the rings, on a batch that does not divide evenly over the ranks.
    shared = pool.run(_train, False, world=world)
    sockets = pool.run(_train, True, world=world)
    for (losses, params), (losses_s, params_s) in zip(shared, sockets, strict=True):
        assert losses == losses_s
        assert params.keys() == params_s.keys()
        assert all(torch.equal(params[k], params_s[k]) for k in params)


def _past_select(group):
    rank = group.rank()
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # the bells come after them
    try:
        comm = _shm.SharedMemoryComm(group, ring_bytes=4096 + 448)
        out = torch.empty(2 * group.size())
        comm.all_gather(out, torch.full((2,), float(rank)), _what).wait()
        assert comm.link is not None
        return comm.link.bell > 1024, out.tolist()
    finally:
        for fd in held:
            os.close(fd)


def test_bells_numbered_past_1024_are_waited_on(pool):
    # Catches: a wait through select(), which refuses descriptors from 1024 on: a process that
    # made many groups (a mesh per test) failed every exchange of the next one.
    for high, values in pool.run(_past_select, world=2):
        assert high and values == [0.0, 0.0, 1.0, 1.0]


def _into_a_released_buffer(group):
    rank = group.rank()
    peer = 1 - rank
    comm = _shm.SharedMemoryComm(group, ring_bytes=4096 + 512)

    def swap(value: float, into: torch.Tensor):
        sends: list = [None, None]
        recvs: list = [None, None]
        sends[peer], recvs[peer] = torch.full((4,), value), into
        return comm.exchange(sends, recvs, _what)

    released = torch.empty(4)
    first = swap(float(rank), released)  # not waited on before its buffer goes
    released.untyped_storage().resize_(0)
    kept = torch.empty(4)
    swap(10.0 + rank, kept).wait()  # reads the first message on the way (the ring is in order)
    first.wait()
    return released.untyped_storage().nbytes(), kept.tolist()


def test_a_receive_into_a_released_buffer_writes_nothing(pool):
    # Catches: a message copied into a buffer whose storage was released before its receive was
    # waited on (a write past the end of freed memory), or the ring left out of step by skipping it.
    for rank, (nbytes, kept) in enumerate(pool.run(_into_a_released_buffer, world=2)):
        assert nbytes == 0
        assert kept == [10.0 + (1 - rank)] * 4


def _sleeps(group):
    """Exchanges where one rank or the other comes late (its peer sleeps on its bell), some
    larger than the ring (the sender thread sleeps on room): how many sleeps each kind of
    thread had, and how many ended by the poll's timeout instead of a bell."""
    rank = group.rank()
    comm = _shm.SharedMemoryComm(group, ring_bytes=4096 + 512)
    real = _shm._ready
    counts = {"main": [0, 0], "sender": [0, 0]}

    def ready(fds, seconds):
        got = real(fds, seconds)
        kind = counts["main" if threading.current_thread() is threading.main_thread() else "sender"]
        kind[0] += 1
        kind[1] += not got
        return got

    _shm._ready = ready
    try:
        values = []
        for k in range(60):
            if (k + rank) % 2:
                time.sleep(0.002)
            n = 4000 if k % 6 == 0 else 8  # 16 KB: four rings' worth, through the sender thread
            out = torch.empty(2 * n)
            comm.all_gather(out, torch.full((n,), float(k + rank)), _what).wait()
            values.append(out[::n].tolist() == [float(k), float(k + 1)])
    finally:
        _shm._ready = real
    return all(values), counts


def test_every_sleep_ends_with_a_bell(pool):
    # Catches: a bell skipped while its peer sleeps (the flag that says so not set, set after
    # the last look at the ring, or not read after the send): a wake-up lost, the exchange
    # late by the poll's timeout (a second on the step's thread, 50 ms on the sender's).
    for same, counts in pool.run(_sleeps, world=2):
        assert same
        slept, timed_out = counts["main"]
        assert slept > 0 and timed_out == 0, counts
        slept, timed_out = counts["sender"]
        assert slept > 0 and timed_out <= slept // 4, counts
