"""Saves in the background: the pending save's thread, ``wait()``, and the second process group it writes over."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from fsdp_fn.checkpoint._integrity import CheckpointError

logger = logging.getLogger("fsdp_fn.checkpoint")  # the package's logger, as docs/checkpoints.md names it


class PendingSave:
    """A save running in the background; ``wait()`` returns its directory or raises its failure.

    ``save(..., blocking=False)`` returns it once the state is copied to host memory; a
    thread then writes it over a second process group. A failure is logged when it
    happens (logger ``fsdp_fn.checkpoint``, warning), for a job that ends without
    waiting, and raised by ``wait()``.

    Attributes:
        directory: where the checkpoint appears once it is committed.
        rank: this process's (global) rank, named in a failure.
    """

    def __init__(self, directory: Path, rank: int, run: Callable[[], None]) -> None:
        self.directory, self.rank = directory, rank
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(run,), name=f"fsdp_fn-save-{directory.name}")
        self._thread.start()

    def _run(self, run: Callable[[], None]) -> None:
        try:
            run()
        except BaseException as e:  # surfaced by wait(); logged too, for a job that ends without waiting
            self._error = e
            logger.warning("the background save of %s failed on rank %d: %s", self.directory, self.rank, e)

    def done(self) -> bool:
        """Whether the writing has ended, committed or failed; never waits.

        Returns:
            ``True`` once the background thread has ended.
        """
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Wait for the writing to end; return the directory or raise the save's failure.

        Returns:
            The directory of the committed checkpoint.

        Raises:
            CheckpointError: naming the directory and the rank, if the save failed.
        """
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(
                f"the background save of {self.directory} failed on rank {self.rank}: {type(error).__name__}: {error}"
            ) from error
        return self.directory


_pending: list[PendingSave] = []


def wait() -> Path | None:
    """Wait for this process's background save, if any; raise its failure (naming the rank).

    ``save`` and ``load`` call it first; call it before the process exits, or a background
    save whose process group is destroyed never commits.

    Returns:
        The directory of the save waited for, or ``None`` when none was pending.

    Raises:
        CheckpointError: naming the directory and the rank, if that save failed.
    """
    if not _pending:
        return None
    return _pending.pop().wait()


_side_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _side_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A second gloo group over the same ranks, for background saves (training keeps the first).

    Made once, by every rank of the default group (``new_group`` is collective over it).
    """
    ranks = tuple(dist.get_process_group_ranks(group))
    if len(ranks) != dist.get_world_size():
        raise ValueError(
            f"blocking=False saves on a second process group made over all {dist.get_world_size()} ranks; "
            f"this state's group holds only ranks {list(ranks)}: save with blocking=True"
        )
    if ranks not in _side_groups:
        made = dist.new_group(list(ranks), backend="gloo")
        assert made is not None
        _side_groups[ranks] = made
    return _side_groups[ranks]
