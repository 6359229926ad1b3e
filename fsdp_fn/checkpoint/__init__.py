"""Sharded checkpoints through torch.distributed.checkpoint (DCP): save, load into a template, reshard.

    ckpt.save("run/step_100", state, extra={"data_pos": 1234})
    state, extra = ckpt.load("run/step_100", like)   # like: a TrainState for the target run

Each rank writes only its own bytes. Entries are keyed by fully-qualified name, in torch's
layout: ``model.<fqn>`` for parameters and buffers, ``optim.state.<fqn>.<name>`` for
optimizer state (``step``, ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``), so a
checkpoint depends on neither the plan nor the world size, and torch FSDP2's
``get_state_dict`` + ``dcp.save`` checkpoints load here (and ours there). ``like`` may use
any world size, plan or mesh: DCP reads, for each rank, only the saved chunks that overlap
its shards; no rank ever holds the full model.

A save is atomic: it writes into a hidden temporary directory, rank 0 writes the commit
marker last, then renames the directory into place. A directory without the marker (a
save killed half-way) is never loaded. ``CheckpointManager`` keeps the last K of its own
step directories and restores the newest that loads; ``blocking=False`` saves in the
background.

A checkpoint directory is untrusted input (``_integrity``): loading runs no code from it
(fsdp_fn's own entries are JSON and tensors; DCP's pickled metadata is read by an
unpickler that admits only DCP's types), reads no file outside it, and refuses damage
(a SHA-256 digest per chunk, written at save, checked at load; ``verify(dir)`` checks a
whole directory). Every failure is a ``CheckpointError``.

Full-model files, streamed (no rank gathers the model): ``export_safetensors`` writes
Hugging Face safetensors (one file, or a sharded set with its index), each rank writing
its own bytes; ``import_safetensors`` reads a ``save_pretrained`` directory into shards,
each rank reading only its slices; ``export_state_dict`` / ``import_state_dict`` do the
same with a plain state dict (on rank 0 / from full tensors).
"""

# The rooms, one concern each: `_save` and `_load` (the two calls), `_background`
# (saves in a thread, on a second group), `_entries` (a state as FQN-keyed DCP entries),
# `_opt_state` (torch.optim's names for an optimizer state), `_per_rank` (RNG states,
# buffers that differ), `_document` (fsdp_fn's own entries as JSON), `_directory` (a
# directory on disk: committed, verified, latest), `_ranks` (groups and agreement on
# errors), `_manager` (`CheckpointManager`), `_integrity` (untrusted input), `_dcp`
# (a shard as DCP chunks), `_export` (safetensors and state dicts).

from fsdp_fn.checkpoint._background import PendingSave, wait
from fsdp_fn.checkpoint._directory import Verified, is_committed, latest, read_metadata, verify
from fsdp_fn.checkpoint._export import export_safetensors, export_state_dict, import_safetensors, import_state_dict
from fsdp_fn.checkpoint._integrity import COMMIT_MARKER, CheckpointError
from fsdp_fn.checkpoint._load import load
from fsdp_fn.checkpoint._manager import CheckpointManager
from fsdp_fn.checkpoint._save import save

__all__ = [
    "COMMIT_MARKER",
    "CheckpointError",
    "CheckpointManager",
    "PendingSave",
    "Verified",
    "export_safetensors",
    "export_state_dict",
    "import_safetensors",
    "import_state_dict",
    "is_committed",
    "latest",
    "load",
    "read_metadata",
    "save",
    "verify",
    "wait",
]
