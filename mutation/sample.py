"""Keep a random sample of a cosmic-ray session's pending mutants; mark the rest skipped.

    python mutation/sample.py SESSION.sqlite N [--seed S]

A full run of the core takes hours on two cores (every mutant spawns the test ranks
afresh), so `make mutate SAMPLE=N` runs N mutants per module, drawn uniformly: the kill
rate of the sample estimates the module's, with the interval cr-rate --estimate prints.
"""

from __future__ import annotations

import argparse
import random

from cosmic_ray.work_db import use_db
from cosmic_ray.work_item import WorkerOutcome, WorkResult


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("session")
    parser.add_argument("n", type=int)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with use_db(args.session) as db:
        pending = sorted(item.job_id for item in db.pending_work_items)
        keep = set(random.Random(args.seed).sample(pending, min(args.n, len(pending))))
        for job in pending:
            if job not in keep:
                db.set_result(job, WorkResult(output="not in the sample", worker_outcome=WorkerOutcome.SKIPPED))
    print(f"{args.session}: {len(keep)} of {len(pending)} mutants sampled (seed {args.seed})")


if __name__ == "__main__":
    main()
