"""A checkpoint directory read without a process group: committed or not, opened and checked, verified, the latest."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import Metadata

from fsdp_fn.checkpoint._document import _document_targets, _read_document
from fsdp_fn.checkpoint._integrity import (
    COMMIT_MARKER,
    CheckpointError,
    Opened,
    marker_step,
    open_checkpoint,
    read_tensor,
    verify_chunks,
)

_META = "fsdp_fn"  # the entry (JSON) holding the step, the writers' world size and the user's extra


def is_committed(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` is a complete checkpoint (its commit marker exists).

    Looks for one file; reads nothing, checks nothing else, needs no process group.

    Args:
        directory: the checkpoint's directory.

    Returns:
        ``True`` when its commit marker exists, ``False`` otherwise (a save still running or
        killed half-way, or no checkpoint at all).
    """
    return (Path(directory) / COMMIT_MARKER).is_file()


def _open(path: Path) -> Opened:
    """The checked checkpoint at ``path``: its marker first, then its digests and metadata."""
    opened = open_checkpoint(path)
    # torch's dcp.save writes no marker and none of our entries; one of ours without it is incomplete.
    if opened.marker is None and _META in opened.metadata.state_dict_metadata:
        raise CheckpointError(
            f"{path} is not a complete checkpoint: it has no {COMMIT_MARKER} marker "
            "(a save was interrupted before every rank finished); load an earlier one (latest())"
        )
    if opened.marker is not None and _META not in opened.metadata.state_dict_metadata:
        raise CheckpointError(f"{path}: its metadata has no {_META!r} entry: it is damaged")
    return opened


def _meta(path: Path, own: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """fsdp_fn's entry (step, world size, extra, the optimizer's plain values), checked."""
    meta = _read_document(path, own, _META)
    if not (
        isinstance(meta, dict)
        and type(meta.get("step")) is int
        and meta["step"] >= 0
        and type(meta.get("world")) is int
        and isinstance(meta.get("optimizer"), dict)
        and "extra" in meta
    ):
        raise CheckpointError(f"{path}: its entry {_META!r} is not what fsdp_fn writes")
    return meta


def verify(directory: str | os.PathLike[str]) -> Verified:
    """Check the whole checkpoint at ``directory`` as ``load`` would, on this process alone.

    Checks its marker, digests and metadata, that every tensor is covered exactly by its
    chunks, that every file it names is inside it, every chunk's bytes against their
    digest, and that fsdp_fn's own entries are the JSON it writes. Reads every byte once;
    runs no code from the directory; needs no process group (no communication).

    Args:
        directory: the checkpoint to check (untrusted input).

    Returns:
        A ``Verified``: the checkpoint's directory and step, and how many chunks and bytes
        were checked.

    Raises:
        CheckpointError: naming the first fault; also for a directory with no commit
            marker and no digests (written by torch's ``dcp.save``: there is nothing to
            check its bytes against).

    Examples:
        >>> verify("/nowhere")
        Traceback (most recent call last):
        ...
        fsdp_fn.checkpoint._integrity.CheckpointError: no checkpoint at /nowhere: no such path
    """
    path = Path(directory)
    opened = _open(path)
    if opened.marker is None:
        raise CheckpointError(
            f"{path} has no {COMMIT_MARKER} marker and no digests (written by torch's dcp.save?): "
            "there is nothing to verify its bytes against; load checks everything else"
        )
    chunks, size = verify_chunks(opened)
    md = opened.metadata
    own = _document_targets(path, md, _META)
    for key, target in own.items():
        indices = [i for i in md.storage_data if i.fqn == key]
        if len(indices) != 1:
            raise CheckpointError(f"{path}: its entry {key!r} is not what fsdp_fn writes (one whole tensor)")
        with open(opened.files[md.storage_data[indices[0]].relative_path], "rb") as stream:
            target.copy_(read_tensor(opened, stream, indices[0], check_digest=True))
    return Verified(path, _meta(path, own)["step"], chunks, size)


def read_metadata(directory: str | os.PathLike[str]) -> Metadata:
    """DCP's metadata of the checkpoint at ``directory``, read as ``load`` reads it.

    Read after the commit marker and against its digest, by an unpickler that admits only
    DCP's metadata types, then checked (chunks, paths). Runs no code from the directory,
    reads no data; needs no process group (no communication).

    Args:
        directory: the checkpoint (untrusted input).

    Returns:
        DCP's ``Metadata``; its entries are in ``.state_dict_metadata``.

    Raises:
        CheckpointError: naming the fault (no checkpoint there, an incomplete or damaged
            one, metadata that is not DCP's).
    """
    return _open(Path(directory)).metadata


class Verified(NamedTuple):
    """What ``verify`` checked: the checkpoint's step, and how many chunks and bytes."""

    directory: Path
    step: int
    chunks: int
    bytes: int


def _committed(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint under ``root`` (its marker's step), oldest first."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.name.startswith(".") or not is_committed(d):
            continue
        step = marker_step(d)
        if step is not None:  # else not one of ours, or damaged: load says which
            found.append((step, d))
    return sorted(found)


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step under ``root`` (incomplete ones are skipped).

    Reads each commit marker under ``root`` (the step is the marker's); a directory whose
    marker fsdp_fn cannot read is skipped too (``load`` says why). Needs no process group.

    Args:
        root: the directory the checkpoints are in.

    Returns:
        The checkpoint's directory, or ``None`` when ``root`` holds no complete checkpoint
        (or does not exist).
    """
    found = _committed(Path(root))
    return found[-1][1] if found else None
