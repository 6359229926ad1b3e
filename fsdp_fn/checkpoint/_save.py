"""``save``: every rank writes its own chunks into a hidden directory; rank 0 commits it, then renames it into place."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from fsdp_fn._errors import DivergenceError, RankFailure
from fsdp_fn._guard import join, run_guarded
from fsdp_fn._shard import ensure_live
from fsdp_fn._step import TrainState
from fsdp_fn.checkpoint._background import PendingSave, _pending, _side_group, wait
from fsdp_fn.checkpoint._dcp import SavePlanner
from fsdp_fn.checkpoint._directory import _META
from fsdp_fn.checkpoint._document import _document, encode
from fsdp_fn.checkpoint._entries import _entries
from fsdp_fn.checkpoint._integrity import CheckpointError, Writer, commit
from fsdp_fn.checkpoint._opt_state import _opt_values
from fsdp_fn.checkpoint._per_rank import _own_buffers, _rng_state
from fsdp_fn.checkpoint._ranks import _agree_on_error, _converted, _group, _mesh


def save(
    directory: str | os.PathLike[str],
    state: TrainState,
    *,
    extra: Any = None,
    hyperparams: Mapping[str, Any] | None = None,
    blocking: bool = True,
    timeout: float = 300.0,
) -> PendingSave | Path:
    """Write ``state`` (shards, optimizer state, buffers, step, each rank's RNG state) to ``directory``.

    Every rank of the state's group calls it (a rank that calls alone gets an error naming
    the ranks that did not join, within ``timeout`` seconds). Each rank writes only its own chunks
    (replicas of a hybrid mesh: only the first) and hashes them (SHA-256, read back from the
    page cache); under tensor parallelism, keyed by the whole parameters' names and shapes,
    each rank its piece's chunks (a parameter the axis does not split: its first rank), as
    FSDP2 + TP's DTensors are written. Rank 0 also writes the replicated values: buffers,
    step counters, and ``extra`` (JSON values, tuples, sets and tensors, e.g. the data loader's position; anything
    else is refused here, naming it, so that loading runs no code), then the digests and
    the commit marker. ``hyperparams`` (torch.optim's names: ``lr``, ``betas``, ...) are
    written as a torch param group, so a torch optimizer loads the checkpoint with a plain
    ``dcp.load``. Atomic: the directory appears, complete, when every rank has written.
    Any failure (a full disk on one rank, say) raises ``CheckpointError`` on every rank.

    ``blocking=False`` copies the shards to host memory (one more copy of the state,
    briefly) and returns a ``PendingSave`` at once; the writing runs in a background
    thread on a second process group, and the next ``save`` or ``wait()`` waits for it. A
    background save whose group is destroyed before it ends (the process exits without
    ``wait()``) never commits. Memory (blocking): one parameter chunk at a time beyond the
    state. Communication: DCP's planning (a gather and a scatter of small plans, the
    digests riding with the write results) and three small barriers.

    Args:
        directory: where the checkpoint appears; it must not exist yet (checkpoints are
            never overwritten).
        state: the ``TrainState`` to write (from ``step.init``); it stays usable.
        extra: what to save beside the state (the data loader's position, say): JSON
            values, tuples, sets and tensors; ``load`` returns it.
        hyperparams: torch.optim's names for the optimizer's settings (``lr``, ``betas``,
            ...), written as a torch param group for torch's loader; fsdp_fn never reads
            them back.
        blocking: ``False`` writes in a background thread on a second process group and
            returns at once.
        timeout: seconds to wait for every rank of the group to call ``save``.

    Returns:
        The checkpoint's path, once it is committed; with ``blocking=False``, a
        ``PendingSave`` whose ``wait()`` returns the path.

    Raises:
        TypeError: if ``state`` is not a ``TrainState``.
        RuntimeError: if ``state``'s shards were donated to a step or left half-updated by
            a failed one.
        CheckpointError: if ``extra`` (or the optimizer state's plain values) holds
            anything but JSON values, tuples, sets and tensors (naming it, before any
            communication); on every rank, if ``directory`` exists already, or creating,
            writing or committing it fails on any rank; also the failure of the previous
            background save, which it waits for first.
        ValueError: if a state sharded over several axes of more than one rank (replicas, a
            tensor-parallel axis) is not over the whole default group, or ``blocking=False`` is
            asked of a group that is not every rank.
        RankFailure: if a rank of the group does not call ``save`` within ``timeout``
            seconds (naming it).
        DivergenceError: if a rank of the group is in another call.
    """
    wait()  # the previous background save, and its failure, come first
    final = Path(directory)
    if not isinstance(state, TrainState):
        raise TypeError(f"save wants a TrainState (from step.init), got {type(state).__name__}")
    ensure_live(state, "checkpoint.save")
    layout = state.params.layout
    group = _group(layout)
    coordinator = group.rank() == 0
    meta = {
        "step": state.step,
        "world": group.size(),
        "mesh": _mesh(layout),
        "extra": extra,
        "optimizer": _opt_values(state.opt_state),
    }
    encode(extra, "extra")  # checked on every rank, before any message, naming what is not JSON
    encode(meta["optimizer"], "the optimizer state")
    own_entries = _document(_META, meta, "the checkpoint", copy=not blocking)
    join(group, "checkpoint.save", timeout)  # a rank that saves alone is named, not left waiting in DCP
    write_shards = layout.first_replica
    if not blocking:
        params, opt_state, buffers = _tree_clone((state.params, state.opt_state, state.buffers))
        state = TrainState(params, opt_state, buffers, state.step)
    entries = _entries(state, write_shards=write_shards, coordinator=coordinator)
    entries.update(_document(f"rng.{dist.get_rank()}", _rng_state(), "the RNG state", copy=not blocking))
    own = _own_buffers(state.buffers, group)
    if own:
        entries.update(_document(f"buffers.{dist.get_rank()}", own, "the per-rank buffers"))
    if coordinator:
        entries.update(own_entries)
        if hyperparams is not None:  # torch's layout, for torch's loader: fsdp_fn never reads these back
            names = [spec.name for unit in layout.plan.units for spec in unit.params]
            for key, value in {**hyperparams, "params": names}.items():
                entries[f"optim.param_groups.0.{key}"] = value

    if blocking:
        _write(final, entries, group, state.step, timeout)
        return final
    side = _side_group(group)
    pending = PendingSave(final, dist.get_rank(), lambda: _write(final, entries, side, state.step, timeout))
    _pending.append(pending)
    return pending


def _tree_clone(tree: Any) -> Any:
    from fsdp_fn._optim import tree_map

    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(final: Path, entries: dict[str, Any], group: dist.ProcessGroup, step: int, timeout: float) -> None:
    if not dist.is_initialized():  # a background save whose process group was destroyed
        raise CheckpointError(
            f"the process group of the save of {final} was destroyed before it could write; nothing was committed"
        )
    coordinator = group.rank() == 0
    tmp = final.parent / f".{final.name}.tmp"
    error = None
    if coordinator:
        if final.exists():
            error = (
                f"{final} already exists; checkpoints are never overwritten (CheckpointManager names them after "
                "state.step, the steps applied, which a step that apply_if_finite skipped leaves as it was: "
                "pass save(state, step=...) the loop's own count)"
            )
        else:
            try:
                shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
                tmp.mkdir(parents=True)
            except OSError as e:
                error = f"cannot create {tmp}: {e}"
    _agree_on_error(group, error)
    writer = Writer(tmp, world=group.size())
    try:
        run_guarded(
            group,
            "checkpoint.save",
            timeout,
            lambda: dcp_save(entries, storage_writer=writer, planner=SavePlanner(), process_group=group),
        )
    except (CheckpointException, Exception) as e:
        if isinstance(e, RankFailure | DivergenceError):
            raise
        raise _converted(e, f"cannot write {final}") from e
    # dcp.save returns once the coordinator has written the metadata after every rank's data.
    if coordinator:
        try:
            commit(tmp, writer, step, group.size())
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(final.parent)
        except OSError as e:  # the others learn of it below instead of waiting for a commit that never comes
            error = f"cannot commit {final}: {e}"
    _agree_on_error(group, error)
