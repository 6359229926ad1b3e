"""The meter against torch's own instruments: FSDP2, FSDP1, DDP and fsdp_fn's step.

``MemoryMeter`` must count what torch's ``FSDPMemTracker`` / ``MemTracker`` count: live
storages that hold data, with a ``DTensor`` counted at its local shard, not its global size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from fsdp_fn._memory import _storages, _tensors
from tests.helpers import gpt_state

CFG = GPTConfig(vocab=64, seq=32, d_model=128, n_layers=6, n_heads=4)
MIB = 2**20


def _batch(rank: int) -> torch.Tensor:
    # Few tokens: the parameters outweigh the activations, so the peak sits in the optimizer,
    # where every parameter is written once (a DTensor counted at its global size shows there).
    return torch.randint(0, CFG.vocab, (1, CFG.seq + 1), generator=torch.Generator().manual_seed(rank))


def _torch_system(
    system: str, group: dist.ProcessGroup, foreach: bool
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(CFG)
    if system == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, "cpu")
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
    elif system == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            model, process_group=group, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu")
        )
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)


def _peaks_torch_system(group: dist.ProcessGroup, system: str, foreach: bool) -> tuple[int, int, int]:
    """(our peak, torch's peak, the bytes of this rank's parameters) over one step, after a warm one."""
    model, opt = _torch_system(system, group, foreach)
    batch = _batch(group.rank())

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        lm_loss(model, batch).backward()
        opt.step()

    step()  # the optimizer state exists from here on
    if system == "fsdp2":
        tracker: MemTracker = FSDPMemTracker(model, opt)
        tracker.track_inputs((batch,))
    else:
        tracker = MemTracker()
        tracker.track_external(model, opt, batch)
    # Both watch the same step: FSDP2's peak moves between runs with when its reduce-scatters finish.
    with tracker, ff.MemoryMeter() as meter:
        meter.tag(list(model.parameters()), "params")
        meter.tag(list(model.buffers()), "buffers")
        meter.tag([v for s in opt.state.values() for v in s.values()], "optimizer")
        meter.tag(batch, "activations")
        step()
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    local = sum(st.nbytes() for p in model.parameters() for st in _storages(p))
    return meter.peak()["total"], theirs, local


class _OpsOnlyTracker(MemTracker):
    """``MemTracker`` without its per-module hooks: under ``torch.func`` a module's parameters are
    functorch wrappers that have no storage, which those hooks read. Its op-level accounting, the
    part compared here, is unchanged."""

    def _pre_fw_hook(self, *args: object) -> None:
        pass

    def _post_fw_hook(self, *args: object) -> None:
        pass

    def _pre_bw_hook(self, *args: object) -> None:
        pass

    def _post_bw_hook(self, *args: object) -> None:
        pass


def _peaks_fsdp_fn(group: dist.ProcessGroup, split_root: bool, update_in_backward: bool) -> tuple[int, int]:
    _, step, state = gpt_state(group, CFG, split_root=split_root, update_in_backward=update_in_backward)
    batch = _batch(group.rank())
    state, _ = step(state, batch)
    tracker = _OpsOnlyTracker()
    tracker.track_external(*_tensors(state), batch)
    with tracker, ff.MemoryMeter() as meter:
        meter.tag(state, "state")
        meter.tag(batch, "activations")
        state, _ = step(state, batch)
    return meter.peak()["total"], tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize(("system", "foreach"), [("fsdp2", False), ("fsdp2", True), ("fsdp1", True), ("ddp", True)])
def test_meter_agrees_with_torch_trackers(pool, system, foreach):
    full = sum(p.numel() * 4 for p in GPT(CFG).parameters())
    for ours, theirs, local in pool.run(_peaks_torch_system, system, foreach, world=2):
        assert theirs > 3 * full / 2  # at least parameters and two Adam moments of one half: a real step
        assert abs(ours - theirs) <= 0.1 * MIB, (system, ours / MIB, theirs / MIB)
        # FSDP2's and FSDP1's parameters are counted at their local shard, DDP's whole.
        assert local == (full if system == "ddp" else pytest.approx(full / 2, abs=4096))


@pytest.mark.parametrize(("split_root", "update_in_backward"), [(False, False), (True, True)])
def test_meter_agrees_with_mem_tracker_on_fsdp_fn(pool, split_root, update_in_backward):
    for ours, theirs in pool.run(_peaks_fsdp_fn, split_root, update_in_backward, world=2):
        assert abs(ours - theirs) <= 0.1 * MIB, (ours / MIB, theirs / MIB)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
def test_meter_agrees_with_the_cuda_allocator():
    """On a GPU the meter's peak is the caching allocator's, less its 512-byte rounding."""
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    x = torch.randn(256, 1024, device="cuda")
    model(x).square().mean().backward()  # warm: cuBLAS's workspace is allocated once, by no op the meter sees
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    with ff.MemoryMeter() as meter:
        meter.tag(list(model.parameters()), "params")
        meter.tag(x, "activations")
        model(x).square().mean().backward()
    torch.cuda.synchronize()
    tagged = sum(t.numel() * t.element_size() for t in [*model.parameters(), x])
    allocator = torch.cuda.max_memory_allocated() - held + tagged
    assert abs(meter.peak()["total"] - allocator) <= 0.1 * MIB, (meter.peak()["total"] / MIB, allocator / MIB)


@pytest.mark.cuda
@cuda
def test_square_norm_on_cuda_is_exact():
    from fsdp_fn._norms import square_norm

    x = torch.randn(5_000_003, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    exact = x.double().square().sum().item()
    assert abs(square_norm(x).item() - exact) <= 1e-9 * exact
