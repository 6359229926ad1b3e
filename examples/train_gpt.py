"""Train a small GPT on Python's standard library source, fully sharded across torchrun ranks.

    torchrun --standalone --nproc-per-node 2 -m examples.train_gpt --steps 200
    torchrun --standalone --nproc-per-node 2 -m examples.train_gpt --steps 300 --resume

The model is built on the meta device and initialised straight into shards; each rank keeps
1/W of every block, embedding and head, gathered just before they run; each unit's AdamW
update runs as soon as its gradient shard exists.
Every --save-every steps the train state is checkpointed (sharded, atomic, the last
--keep kept) under --ckpt-dir; --resume continues from the latest one, exactly at the same
world size, and at another one on the samples after those already read.
Rank 0 shows a progress bar; the last line gives tokens/s and each rank's peak memory.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import fsdp_fn as ff
import fsdp_fn.checkpoint as ckpt
from examples.gpt import GPT, Block, GPTConfig, lm_loss, stdlib_text, token_windows


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default="checkpoints/gpt", help="where checkpoints go")
    p.add_argument("--save-every", type=int, default=50, help="steps between checkpoints (0: never)")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    cfg = GPTConfig(vocab=256, seq=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    with torch.device("meta"):  # no rank ever holds the whole model: built unit by unit into shards
        model = GPT(cfg)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]), split_root=True)
    params, buffers = ff.init_shards(model, plan, seed=args.seed)
    in_backward = ff.Schedule(update_in_backward=True)  # each unit steps as soon as its gradient shard exists
    step = ff.train_step(fn, lm_loss, ff.adamw(lr=args.lr, weight_decay=0.1), schedule=in_backward)
    state = step.init(params, buffers)
    manager = ckpt.CheckpointManager(args.ckpt_dir, keep=args.keep)
    resumed = manager.restore(state) if args.resume else None
    samples = 0  # the data position: sequences every rank together has read
    if resumed is not None:
        state, extra = resumed
        samples = extra["samples"]
        if rank == 0:
            print(f"resumed from {manager.latest()} at step {state.step}, sample {samples}", flush=True)
    text = stdlib_text()
    if rank == 0:
        print(
            f"{plan.numel / 1e6:.2f}M parameters in {len(plan.units)} units over {world} ranks; "
            f"{len(text) / 1e6:.1f} MB of text",
            flush=True,
        )

    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=state.step, unit="step", dynamic_ncols=True)
    first_loss = None
    start = time.perf_counter()
    timed_from = min(state.step + 5, args.steps - 1)  # leave the first steps (warm-up) out of tokens/s
    meter_step = args.steps - 1
    peak = 0
    loss = float("nan")
    for k in range(state.step, args.steps):
        if k == timed_from:
            start = time.perf_counter()
        mine = samples + rank * args.batch  # this rank's part of the global batch, by sample index
        batch = token_windows(text, range(mine, mine + args.batch), args.seq, seed=args.seed)
        samples += args.batch * world
        if k == meter_step:
            with ff.MemoryMeter() as meter:
                meter.tag(state, "state")
                state, metrics = step(state, batch)
            peak = meter.peak()["total"]
        else:
            state, metrics = step(state, batch)
        loss = metrics["loss"].item()
        first_loss = loss if first_loss is None else first_loss
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}")
            bar.update()
        if args.save_every and (k + 1) % args.save_every == 0:
            manager.save(state, step=k + 1, extra={"samples": samples})  # any world size reads on from there
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    tokens = (args.steps - timed_from) * args.batch * args.seq * world
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0 and first_loss is not None:
        mib = ", ".join(f"rank {r}: {p / 2**20:.1f} MiB" for r, p in enumerate(peaks))
        print(
            f"loss {first_loss:.3f} -> {loss:.3f} | {tokens / elapsed:,.0f} tokens/s | "
            f"peak memory per rank (live tensors) {mib}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
