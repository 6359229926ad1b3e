"""The job of the elastic-restart test: torchrun restarts it after a rank is killed; it resumes.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m tests.elastic_job ROOT OUT STEPS KILL_AT

Checkpoints every 2 steps (the data position in ``extra``); on the first attempt rank 1
SIGKILLs itself before step KILL_AT. Rank 0 saves the final parameters to OUT.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist

import fsdp_fn as ff
import fsdp_fn.checkpoint as ckpt
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from tests.helpers import batch_for, local_part

CFG = GPTConfig(vocab=37, seq=9, d_model=12, n_layers=3, n_heads=2)


def train(group, root: str, steps: int, kill_at: int | None = None) -> dict[str, torch.Tensor]:
    rank, world = group.rank(), group.size()
    torch.manual_seed(0)
    model = GPT(CFG)
    fn = ff.functionalize(model)
    step = ff.train_step(fn, lm_loss, ff.adamw(lr=1e-2))
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([Block])), group))
    manager = ckpt.CheckpointManager(root, keep=2)
    start = 0
    restored = manager.restore(state)
    if restored is not None:
        state, extra = restored
        start = extra["next"]
    for k in range(start, steps):
        if k == kill_at and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        state, _ = step(state, local_part(batch_for("gpt", model, k), rank, world))
        if (k + 1) % 2 == 0:
            manager.save(state, extra={"next": k + 1})
    return {**ff.unshard(state.params), "resumed_from": torch.tensor(start)}


if __name__ == "__main__":
    root, out, steps, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    os.makedirs(root, exist_ok=True)
    torch.set_num_threads(1)
    # A store of its own per attempt: torchrun's shared store can hand a restarted worker the
    # address of the worker it replaced (pytorch/pytorch#135712).
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.FileStore(os.path.join(root, f".store-attempt-{attempt}"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    group = dist.group.WORLD
    full = train(group, root, steps, kill_at)
    if dist.get_rank() == 0:
        full["restarts"] = torch.tensor(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        torch.save(full, out)
    dist.destroy_process_group()
