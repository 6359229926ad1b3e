"""Two checkouts of fsdp_fn, alternated in one window: the tiny GPT's step on each.

Separate runs drift more than most changes move a step, so this runs the same step (the
GPT of ``bench/overhead.py``: d 64, vocab 512, 2x32 tokens per rank) from checkout A, then
from checkout B, ``--runs`` times, each in a fresh pool of ranks, and prints each run's median
step (slowest rank), the step thread's CPU time and the process's (every thread), and, over
as many steps again with a phase clock open, fsdp_fn's own phases' CPU time (the sum of
``overhead.py``'s phase split; each checkout's own clock).

    git worktree add /tmp/before <commit>
    python bench/ab_checkouts.py /tmp/before . --layers 16 --runs 3      # CPU, gloo, W=2
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

RUN = r"""
import json, statistics, sys, time
sys.path.insert(0, {repo!r})
import torch, torch.distributed as dist
import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from fsdp_fn.testing import RankPool
from fsdp_fn._phases import phase_clock


def run(group, layers, steps):
    cfg = GPTConfig(vocab=512, seq=32, d_model=64, n_layers=layers, n_heads=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(group.rank())
    fn = ff.functionalize(model)
    step = ff.train_step(fn, lm_loss, ff.adamw(lr=1e-3))
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([Block])), group))
    wall, thread, process, own = [], [], [], []
    for i in range(steps + 5):
        batch = torch.randint(0, 512, (2, 33), generator=g)
        dist.barrier(group=group)
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        state, _ = step(state, batch)
        if i >= 5:
            wall.append(time.perf_counter() - t0)
            thread.append(time.thread_time() - c0)
            process.append(time.process_time() - p0)
    for i in range(steps):  # the same steps again, each with a phase clock open: fsdp_fn's own phases
        batch = torch.randint(0, 512, (2, 33), generator=g)
        dist.barrier(group=group)
        with phase_clock() as clock:
            state, _ = step(state, batch)
        own.append(sum(clock.cpu_seconds.values()))
    return [statistics.median(x) for x in (wall, thread, process, own)]


if __name__ == "__main__":
    with RankPool({world}, warnings_as_errors=False) as pool:
        ranks = pool.run(run, {layers}, {steps})
        print(json.dumps([max(r[k] for r in ranks) for k in range(4)]))
"""


def once(repo: pathlib.Path, layers: int, steps: int, world: int) -> list[float]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(RUN.format(repo=str(repo), layers=layers, steps=steps, world=world))
    done = subprocess.run([sys.executable, f.name], capture_output=True, text=True, cwd=repo)
    if done.returncode != 0:
        raise SystemExit(f"{repo}: {done.stderr[-3000:]}")
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=pathlib.Path)
    p.add_argument("b", type=pathlib.Path)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    results: dict[pathlib.Path, list[list[float]]] = {args.a: [], args.b: []}
    for _ in range(args.runs):
        for repo in (args.a, args.b):
            results[repo].append(once(repo.resolve(), args.layers, args.steps, args.world))
    print(f"# tiny GPT, {args.layers} blocks, CPU, gloo, W={args.world}: each run's median, ms")
    for repo, runs in results.items():
        wall, thread, process, own = ([f"{1e3 * r[k]:.1f}" for r in runs] for k in range(4))
        print(
            f"{repo}: step {', '.join(wall)}; step thread's CPU {', '.join(thread)}; process CPU {', '.join(process)}; "
            f"own phases' CPU {', '.join(own)} (a phase clock open, the step thread's CPU in fsdp_fn's phases)"
        )


if __name__ == "__main__":
    main()
