"""The kill rate of a cosmic-ray session, counting only mutants that ran (not the filtered or unsampled).

python mutation/score.py SESSION.sqlite
"""

from __future__ import annotations

import sys
from collections import Counter

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome


def main() -> None:
    with use_db(sys.argv[1], WorkDB.Mode.open) as db:
        outcomes = Counter()
        for _, result in db.results:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                outcomes["skipped"] += 1
            elif result.worker_outcome != WorkerOutcome.NORMAL:
                outcomes[f"worker {result.worker_outcome.value}"] += 1  # exception, abnormal: not run
            else:
                outcomes["killed" if result.test_outcome == TestOutcome.KILLED else "survived"] += 1
        pending = db.num_work_items - db.num_results
    ran = outcomes["killed"] + outcomes["survived"]
    score = f"{100 * outcomes['killed'] / ran:.0f}%" if ran else "n/a"
    print(f"ran {ran} (pending {pending}): killed {outcomes['killed']}, survived {outcomes['survived']}: {score}")
    print(dict(outcomes))


if __name__ == "__main__":
    main()
