#!/usr/bin/env bash
# Run a session's surviving mutants again against the tests as they are now in the checkout
# and test commands (after a test was added to kill them): `mutation/retry.sh collectives`
# after `make mutate`. The module itself stays as it was when the session began.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
work=${MUTATE_DIR:-${TMPDIR:-/tmp}/fsdp_fn-mutate}
bin="$root/.venv/bin"
cd "$work"
rm -rf tests && (cd "$root" && git ls-files -z tests mutation | xargs -0 cp -P --parents -t "$work")
for m in "$@"; do
    db="$work/$m.sqlite"
    # Today's tests must pass on the module as the session found it, or every mutant looks killed.
    "$bin/cosmic-ray" baseline "mutation/$m.toml"
    "$bin/python" - "$db" <<'PY'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
n = db.execute("DELETE FROM work_results WHERE test_outcome = 'SURVIVED'").rowcount
db.commit()
print(f"{sys.argv[1]}: {n} surviving mutants to run again")
PY
    "$bin/cosmic-ray" exec "mutation/$m.toml" "$db"
    "$bin/cr-report" --show-diff --surviving-only "$db" > "$root/mutation/results/$m.txt" || true
    "$bin/python" "$root/mutation/score.py" "$db" | tee -a "$root/mutation/results/$m.txt"
done
