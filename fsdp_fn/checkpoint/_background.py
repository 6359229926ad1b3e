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
    """A save running in the background; ``wait()`` returns its directory or raises its failure."""

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
        return not self._thread.is_alive()

    def wait(self) -> Path:
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(
                f"the background save of {self.directory} failed on rank {self.rank}: {type(error).__name__}: {error}"
            ) from error
        return self.directory


_pending: list[PendingSave] = []


def wait() -> Path | None:
    """Wait for this process's background save, if any; raise its failure (naming the rank)."""
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
