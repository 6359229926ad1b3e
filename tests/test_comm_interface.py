"""One communication interface, chosen once per group: which comm a group gets, the wait each
comm's handles take, the log that every comm's collectives go through, and a comm of the user's
carrying a real train step."""

from __future__ import annotations

import os
import types
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import fsdp_fn as ff
from examples.gpt import GPTConfig
from fsdp_fn import _collectives as C
from fsdp_fn import _comm, _guard
from fsdp_fn._shm import SharedMemoryComm
from tests.helpers import gpt_state, local_part, rows_fetched

CFG = GPTConfig(vocab=50, seq=8, d_model=12, n_layers=2, n_heads=2)


class Counting(ff.Comm):
    """Wraps another comm and counts the calls of each method (what a user's own comm looks like)."""

    def __init__(self, inner: ff.Comm) -> None:
        super().__init__(inner.group)
        self.inner, self.calls = inner, Counter()
        self.pairwise = inner.pairwise

    def buffer(self, numel, dtype, device):
        self.calls["buffer"] += 1
        return self.inner.buffer(numel, dtype, device)

    def regrow(self, buffer):
        self.calls["regrow"] += 1
        self.inner.regrow(buffer)

    def free(self, buffer):
        self.calls["free"] += 1
        self.inner.free(buffer)

    def all_gather(self, out, shard, what, own=None):
        self.calls["all_gather"] += 1
        return self.inner.all_gather(out, shard, what, own)

    def reduce_scatter(self, full, what):
        self.calls["reduce_scatter"] += 1
        return self.inner.reduce_scatter(full, what)

    def all_reduce(self, tensor, what):
        self.calls["all_reduce"] += 1
        return self.inner.all_reduce(tensor, what)

    def all_reduce_apart(self, tensor, what):
        self.calls["all_reduce"] += 1
        return self.inner.all_reduce_apart(tensor, what)

    def broadcast(self, tensor, src, what):
        self.calls["broadcast"] += 1
        return self.inner.broadcast(tensor, src, what)

    def exchange(self, sends, recvs, what):
        self.calls["exchange"] += 1
        return self.inner.exchange(sends, recvs, what)


def _fake_group(backend: str, size: int = 2):
    return types.SimpleNamespace(backend=backend, size=lambda: size, group_name=f"fake-{backend}")


def test_the_default_comm_follows_the_backend(monkeypatch):
    # Catches: NCCL not given its streams, gloo's pairwise path given to another backend, a
    # CUDA comm chosen on a machine without a GPU. (Made, not run: its streams come at first use.)
    monkeypatch.setattr(dist, "get_backend", lambda group: group.backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert type(_comm.default_comm(_fake_group("nccl"), pairwise=False)) is _comm.CudaComm
    assert type(_comm.default_comm(_fake_group("gloo"), pairwise=True)) is _comm.PairwiseComm
    assert type(_comm.default_comm(_fake_group("mpi"), pairwise=False)) is _comm.NativeComm
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert type(_comm.default_comm(_fake_group("nccl"), pairwise=False)) is _comm.NativeComm
    # the rule: gloo with two ranks or more, unless FSDP_FN_COLLECTIVES=native
    assert C.pairwise(_fake_group("gloo")) and not C.pairwise(_fake_group("gloo", 1))
    assert not C.pairwise(_fake_group("nccl"))
    monkeypatch.setenv("FSDP_FN_COLLECTIVES", "native")
    assert not C.pairwise(_fake_group("gloo"))


def test_only_a_pairwise_comm_exchanges():
    # Catches: a lookup sent to fetch rows over a comm that cannot send point to point.
    comm = _comm.Comm(_fake_group("nccl"))
    assert not comm.pairwise
    with pytest.raises(NotImplementedError, match="no point-to-point exchange"):
        comm.exchange([], [], lambda: "row-fetch")


def _chosen_once(group):
    world = group.size()
    comm = ff.comm_of(group)
    kinds = [type(comm).__name__, comm.pairwise, ff.comm_of(group) is comm]
    before = os.environ.get("FSDP_FN_COLLECTIVES")
    os.environ["FSDP_FN_COLLECTIVES"] = "native"
    try:
        kinds.append(ff.comm_of(group) is comm)  # chosen once: the environment is read at the choice
        ff.set_comm(group, None)  # back to the default choice: made again, now native
        kinds.append(type(ff.comm_of(group)).__name__)
    finally:
        if before is None:
            del os.environ["FSDP_FN_COLLECTIVES"]
        else:
            os.environ["FSDP_FN_COLLECTIVES"] = before
        ff.set_comm(group, None)
    kinds.append(type(ff.comm_of(group)).__name__)
    other = ff.Comm(dist.group.WORLD)
    try:
        if world < dist.get_world_size():
            ff.set_comm(group, other)
    except ValueError as e:
        kinds.append("over group" in str(e))
    return kinds


def test_a_group_chooses_its_comm_once(pool):
    # Catches: the choice made again at every collective (the environment read per call), a
    # set_comm(None) that does not go back to the default, a comm set on a group it does not serve.
    assert pool.run(_chosen_once, world=1)[0] == ["NativeComm", False, True, True, "NativeComm", "NativeComm", True]
    shared = "SharedMemoryComm"  # (the default on one host)
    assert pool.run(_chosen_once, world=2)[0] == [shared, True, True, True, "NativeComm", shared, True]


def _waits_by_kind(group):
    world, rank = group.size(), group.rank()
    seen = []
    watched, polled = _guard.Guard.wait_watched, _guard.Guard.wait_polled

    def spy_watched(self, *args):
        seen.append("watched")
        return watched(self, *args)

    def spy_polled(self, *args):
        seen.append("polled")
        return polled(self, *args)

    _guard.Guard.wait_watched, _guard.Guard.wait_polled = spy_watched, spy_polled
    results = []
    try:
        for comm in (_comm.PairwiseComm(group), _comm.NativeComm(group), SharedMemoryComm(group)):
            saved = ff.set_comm(group, comm)
            try:
                firsts = []  # the first wait of each (a polled wait may hand over to a waiter after)
                with _guard.guarded(group, f"waits on {type(comm).__name__}", timeout=60.0):
                    out = torch.empty(3 * world)
                    C.all_gather_into(out, torch.full((3,), float(rank)), group, "u")
                    firsts.append(seen[0])
                    seen.clear()
                    total = C.all_reduce_(torch.ones(2), group)
                    firsts.append(seen[0])
                    seen.clear()
                results.append(
                    (torch.equal(out, torch.arange(world).repeat_interleave(3).float()), total.tolist(), firsts)
                )
            finally:
                ff.set_comm(group, saved)
    finally:
        _guard.Guard.wait_watched, _guard.Guard.wait_polled = watched, polled
    return results


def test_each_comm_waits_under_the_guard(pool):
    # Catches: a wait that bypasses the guard (a rank that is gone would hang the others), a
    # pairwise exchange polled (gloo cannot say whether it is done), gloo's own collectives
    # not polled. The all-reduce is gloo's own on both.
    for pairwise, native, shared in pool.run(_waits_by_kind, world=2):
        assert pairwise == (True, [2.0, 2.0], ["watched", "polled"])
        assert native == (True, [2.0, 2.0], ["polled", "polled"])
        assert shared == (True, [2.0, 2.0], ["watched", "polled"])


def _steps(group, counting, steps=2):
    world, rank = group.size(), group.rank()
    comm = Counting(ff.comm_of(group)) if counting else None
    saved = ff.set_comm(group, comm) if counting else None
    try:
        with rows_fetched():  # the lookups fetch their rows: the comm's exchange carries them
            plan, step, state = gpt_state(group, CFG, split_root=True)
            logs = []
            for k in range(steps):
                g = torch.Generator().manual_seed(k)
                batch = local_part(torch.randint(0, CFG.vocab, (2 * world, CFG.seq + 1), generator=g), rank, world)
                with ff.comm_log() as log:
                    state, metrics = step(state, batch)
                logs.append(Counter((c.op, c.unit, c.numel, c.dtype) for c in log.records))
    finally:
        if counting:
            ff.set_comm(group, saved)
    full = ff.unshard(state.params)
    return full, float(metrics["loss"]), logs, dict(comm.calls) if comm is not None else {}


def test_a_comm_of_the_users_carries_a_train_step(pool):
    # Catches: a collective (or a buffer) that bypasses the group's comm, a user's comm that
    # changes the numbers, a collective that the log misses when the comm is not fsdp_fn's own.
    plain = pool.run(_steps, False, world=2)
    counted = pool.run(_steps, True, world=2)
    for (full, loss, logs, _), (full_c, loss_c, logs_c, calls) in zip(plain, counted):
        assert loss == loss_c
        assert full.keys() == full_c.keys()
        assert all(torch.equal(full[k], full_c[k]) for k in full)
        assert logs == logs_c  # the log sits above the comm: the same records, the same bytes
        issued = sum(logs_c, Counter())
        ops = Counter()
        for (op, *_), n in issued.items():
            ops[op] += n
        # Every collective of the steps went through the comm: one call per record (a row
        # fetch is three exchanges, a row reduce one), the step's own metrics gather included.
        assert calls["all_gather"] == ops["all_gather"]
        assert calls["reduce_scatter"] == ops["reduce_scatter"]
        assert calls["exchange"] == 3 * ops["row_fetch"] + ops["row_reduce"] > 0
        # Every gathered buffer came from the comm, and was freed by it.
        assert calls["buffer"] > 0 and calls["free"] > 0


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
def test_cuda_comm_orders_its_streams():
    """NCCL over one rank: the gather and the reduce-scatter run on the comm's own streams and
    the compute stream reads their results only after their events."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        group = dist.group.WORLD
        comm = _comm.CudaComm(group)
        buffer = comm.buffer(1 << 20, torch.float32, torch.device("cuda"))
        shard = torch.randn(1 << 20, device="cuda")
        pending = comm.all_gather(buffer, shard, lambda: "all-gather")
        assert comm.stream(buffer.device, "all_gather") != torch.cuda.current_stream()
        pending.wait()
        torch.testing.assert_close(buffer.clone(), shard, rtol=0, atol=0)
        got = comm.reduce_scatter(shard * 2, lambda: "reduce-scatter")()
        torch.testing.assert_close(got, shard * 2, rtol=0, atol=0)
        comm.free(buffer)
        comm.regrow(buffer)
        assert buffer.untyped_storage().nbytes() == buffer.numel() * 4
        torch.cuda.synchronize()
    finally:
        if started:
            dist.destroy_process_group()
