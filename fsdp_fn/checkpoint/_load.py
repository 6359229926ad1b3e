"""``load``: a checkpoint, checked as untrusted input on every rank, read into the layout of a template state."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from fsdp_fn._agree import gather_objects
from fsdp_fn._errors import DivergenceError, RankFailure
from fsdp_fn._guard import join, run_guarded
from fsdp_fn._shard import ensure_live
from fsdp_fn._step import TrainState
from fsdp_fn.checkpoint._background import wait
from fsdp_fn.checkpoint._dcp import LoadPlanner, Pieces
from fsdp_fn.checkpoint._directory import _META, _meta, _open
from fsdp_fn.checkpoint._document import _document_targets, _read_document
from fsdp_fn.checkpoint._entries import _Target, _target
from fsdp_fn.checkpoint._integrity import CheckpointError, Opened, Reader
from fsdp_fn.checkpoint._opt_state import _opt_fields, _opt_values, _rebuild
from fsdp_fn.checkpoint._per_rank import _set_rng_state
from fsdp_fn.checkpoint._ranks import _converted, _group, _mesh


def load(
    directory: str | os.PathLike[str], like: TrainState, *, check_digests: bool = True, timeout: float = 300.0
) -> tuple[TrainState, Any]:
    """Read the checkpoint at ``directory`` into the layout of ``like``; return the state and ``extra``.

    ``like`` is a ``TrainState`` for the target run (``step.init(shard(...))``, or from
    ``init_shards`` with ``device="meta"``): any world size, plan, or mesh. Its tensors
    are filled in place and returned (donated; meta tensors are replaced by new ones).
    Each rank reads only the saved chunks that overlap its shards (under tensor parallelism,
    of its piece of each parameter: a checkpoint of another mesh, or of FSDP2 + TP, loads). The
    RNG state of each rank is restored when the mesh (each axis's role and size) is the one that saved.

    The directory is untrusted: its commit marker is read first, then the digests and
    DCP's metadata against it (no code from the directory runs, no file outside it is
    read), and every tensor must be covered exactly by its chunks. A missing, unexpected,
    mis-shaped or mis-typed parameter, an incomplete, damaged or truncated checkpoint
    raise ``CheckpointError`` naming it, on every rank, before anything is read; each chunk
    a rank reads is checked against its SHA-256 digest before it is used
    (``check_digests=False`` skips that, not the rest: docs/checkpoints.md has the cost).
    A checkpoint written by torch's ``dcp.save`` (FSDP2) has no marker and no digests and
    loads with the other checks. Communication: DCP's planning (a gather and a scatter of
    small plans) and one small all-gather of the ranks' checks.

    Args:
        directory: the checkpoint to read (untrusted input).
        like: a ``TrainState`` for the target run, of any world size, plan or mesh; its
            tensors are filled in place (donated: use the state returned).
        check_digests: ``False`` skips checking each chunk read against its SHA-256
            digest (and only that).
        timeout: seconds to wait for every rank of the group to call ``load``.

    Returns:
        The state loaded, in ``like``'s layout, with the step saved, and the ``extra``
        saved with it (``None`` for a checkpoint written by torch, whose step is its
        optimizer's step counter).

    Raises:
        TypeError: if ``like`` is not a ``TrainState``.
        RuntimeError: if ``like``'s shards were donated to a step or left half-updated by
            a failed one.
        CheckpointError: on every rank, naming the fault, if the checkpoint is
            incomplete, damaged or truncated, or misses, adds, reshapes or retypes a
            parameter of ``like``; later, if a chunk does not match its digest, a rank's
            RNG state or buffers are damaged, or the optimizer state was saved by another
            chain of links. Also the failure of the previous background save, which it
            waits for first.
        ValueError: if a state sharded over several axes of more than one rank (replicas, a
            tensor-parallel axis) is not over the whole default group.
        RankFailure: if a rank of the group does not call ``load`` within ``timeout``
            seconds (naming it).
        DivergenceError: if a rank of the group is in another call.
    """
    wait()
    path = Path(directory)
    if not isinstance(like, TrainState):
        raise TypeError(f"load wants a TrainState to load into (step.init(...)), got {type(like).__name__}")
    ensure_live(like, "checkpoint.load")
    group = _group(like.params.layout)
    join(group, "checkpoint.load", timeout)
    rank = dist.get_rank()
    rng_key, buffers_key = f"rng.{rank}", f"buffers.{rank}"
    raised: Exception | None = None
    try:
        opened = _open(path)
        target = _target(like)
        _check(path, opened, target, like)
        own: dict[str, torch.Tensor] = {}
        if opened.marker is not None:
            for key in (_META, rng_key, buffers_key):
                own.update(_document_targets(path, opened.metadata, key))
    except Exception as e:  # a file the system refuses too: every rank must reach the all-gather below
        raised = e if isinstance(e, CheckpointError) else CheckpointError(f"{path}: {type(e).__name__}: {e}")
    # Every rank raises, or none: a rank that went on alone would wait in DCP's collectives.
    errors = gather_objects(None if raised is None else str(raised), group, "checkpoint.load")
    if raised is not None:
        raise raised
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError(f"rank {failed[0][0]} cannot load {path}: {failed[0][1]}")
    entries = {**target.entries, **own}
    try:
        reader = Reader(opened, check_digests=check_digests)
        run_guarded(
            group,
            "checkpoint.load",
            timeout,
            lambda: dcp_load(entries, storage_reader=reader, planner=LoadPlanner(), process_group=group),
        )
    except (CheckpointException, Exception) as e:
        if isinstance(e, RankFailure | DivergenceError):
            raise
        raise _converted(e, f"cannot load {path}") from e
    for tree in (like.params, *(v for _, v in _opt_fields(like.opt_state))):
        tree.consumed = f"its tensors were loaded into by checkpoint.load({str(path)!r}): use the state it returned"
    loaded = target.state
    if opened.marker is None:  # written by torch (FSDP2): its optimizer's step, no extra
        return loaded._replace(step=_torch_step(target)), None
    meta = _meta(path, own)
    if _same_ranks(meta, like, group):  # each its own RNG state and buffers
        try:
            if rng_key in own:
                _set_rng_state(_read_document(path, own, rng_key))
            buffers = _read_document(path, own, buffers_key) if buffers_key in own else {}
            for name, value in buffers.items():
                if name in loaded.buffers:
                    loaded.buffers[name].copy_(value)
        except (TypeError, ValueError, RuntimeError, KeyError, AttributeError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{path}: rank {rank}'s RNG state or buffers are damaged ({e})") from e
    values = meta["optimizer"]
    if values:  # a chain's counters, as saved
        _check_values(path, values, _opt_values(loaded.opt_state))
        same = {id(v): v for _, v in _opt_fields(loaded.opt_state)}
        loaded = loaded._replace(opt_state=_rebuild(loaded.opt_state, same, values))
    return loaded._replace(step=meta["step"]), meta["extra"]


def _same_ranks(meta: Mapping[str, Any], like: TrainState, group: dist.ProcessGroup) -> bool:
    """Whether the ranks that saved are the ranks that load, each at the same place of the same mesh
    (a checkpoint from before meshes were recorded: of the same world size, and no tensor axis)."""
    mesh = _mesh(like.params.layout)
    if "mesh" not in meta:
        return meta["world"] == group.size() and like.params.layout.tensor_axis is None
    return bool(meta["world"] == group.size() and meta["mesh"] == mesh)


def _check(path: Path, opened: Opened, target: _Target, like: TrainState) -> None:
    """Raise ``CheckpointError`` naming the first parameter the checkpoint cannot fill (the same on every rank)."""
    saved = opened.metadata.state_dict_metadata
    names = {n for spec in like.params.plan.params for n in (spec.name, *spec.aliases)}
    unexpected = [k[6:] for k in saved if k.startswith("model.") and k[6:] not in names and k[6:] not in like.buffers]
    if unexpected:
        raise CheckpointError(
            f"{path} has parameter {unexpected[0]!r} that the target model does not have"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
            + ": saved from another model?"
        )
    fresh = _never_stepped(saved, target)
    for key, (shape, dtype, what) in target.expected.items():
        if key not in saved:
            if what.startswith("buffer") and key[6:] in like.params.plan.non_persistent:
                del target.entries[key]  # not in a state_dict (FSDP2's checkpoints lack it): keep like's
                continue
            if key in fresh:  # as torch.optim has it: no state yet, a fresh start
                _zero(target.entries.pop(key, None))
                continue
            if what.startswith("buffer"):
                raise CheckpointError(
                    f"{path} has no {what}, a persistent buffer of the target model (in its state_dict): saved "
                    "from another model? (only buffers registered with persistent=False may be missing)"
                )
            raise CheckpointError(f"{path} has no {what}: missing from the checkpoint")
        entry = saved[key]
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{path}: {what} is saved as an object, not a tensor")
        if tuple(entry.size) != shape:
            raise CheckpointError(
                f"{path}: {what} has shape {tuple(entry.size)} in the checkpoint, {shape} in the target"
            )
        if entry.properties.dtype != dtype:
            raise CheckpointError(
                f"{path}: {what} is {entry.properties.dtype} in the checkpoint, {dtype} in the target"
            )
    _check_files(path, opened, target)


def _never_stepped(saved: Mapping[str, Any], target: _Target) -> set[str]:
    """The optimizer keys of the parameters the checkpoint holds no optimizer state for at all,
    while it holds some for others: torch.optim makes a parameter's state at its first step,
    so a torch checkpoint of a head not used yet has none. Those load as a fresh start."""
    if not any(k.startswith("optim.state.") for k in saved):
        return set()
    names = [tname for tname, _ in _opt_fields(target.state.opt_state)]
    fresh: set[str] = set()
    for unit in target.state.params.plan.units:
        for spec in unit.params:
            keys = [f"optim.state.{spec.name}.{tname}" for tname in names]
            if not any(k in saved for k in keys):
                fresh.update(keys)
    return fresh


def _zero(entry: Any) -> None:
    """Zero the tensors a load would have read into (a parameter's step count and moments)."""
    if isinstance(entry, Pieces):
        for chunk in entry.chunks.values():
            chunk.zero_()
    elif isinstance(entry, torch.Tensor):
        entry.zero_()


def _check_files(path: Path, opened: Opened, target: _Target) -> None:
    """Every chunk to read lies inside its data file: a truncated file is named with a parameter in it."""
    sizes: dict[str, int] = {}
    for index, info in opened.metadata.storage_data.items():
        key = index.fqn
        if key not in target.entries:
            continue
        name = info.relative_path
        if name not in sizes:
            file = opened.files[name]
            sizes[name] = file.stat().st_size if file.is_file() else -1
        if sizes[name] < info.offset + info.length:
            state = "missing" if sizes[name] < 0 else f"truncated ({sizes[name]} bytes)"
            raise CheckpointError(
                f"{path}: the data of {target.expected[key][2]} is in {name}, which is {state}; "
                "the checkpoint is corrupt"
            )


def _torch_step(target: _Target) -> int:
    """The step of a checkpoint written by torch: its optimizer's step counter (0 without one)."""
    steps = [v for k, v in target.entries.items() if k.endswith(".step") and isinstance(v, torch.Tensor)]
    return int(steps[0].item()) if steps else 0


def _check_values(path: Path, saved: Mapping[str, Any], template: Mapping[str, Any]) -> None:
    """The optimizer's plain values in the checkpoint are the template's, of the same kinds (a chain's
    counters): a chain that wraps its links otherwise would silently restart their counts."""
    # (which parameters a round reached is data, there only once some are: not the chain's shape)
    counters, wanted = ({k for k in names if not k.endswith(".received")} for names in (saved, template))
    if counters != wanted:
        only_saved, only_here = sorted(counters - wanted), sorted(wanted - counters)
        raise CheckpointError(
            f"{path}: its optimizer state was saved by another chain of links: it holds "
            f"{', '.join(map(repr, only_saved)) or 'nothing more'} where the target's optimizer keeps "
            f"{', '.join(map(repr, only_here)) or 'nothing more'} (an accumulate's or apply_if_finite's counters "
            "under another path). Load it into a state made by the same optimizer, its links wrapped the same way"
        )
    for name, value in saved.items():
        if name not in template:
            continue  # (a round's reached parameters)
        like = template[name]
        same = type(value) is type(like)
        if same and isinstance(value, torch.Tensor):
            same = value.shape == like.shape and value.dtype == like.dtype
        if not same:
            raise CheckpointError(
                f"{path}: the optimizer state's {name!r} is {value!r} in the checkpoint, a {type(like).__name__} "
                "in the target"
            )
