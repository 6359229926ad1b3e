#!/usr/bin/env bash
# Mutation testing of the core with cosmic-ray: `make mutate` (or `mutation/run.sh collectives shard plan`).
#
# cosmic-ray mutates a file on disk and runs a test command, so it sees what the spawned
# rank processes run (a coverage-tracing tool would see only the pytest process). It
# mutates files in place: this script works on a copy of the tree (tracked files, as they
# are in the working tree), so the checkout is never touched. One module at a time, one
# mutant at a time; results in mutation/results/<module>.txt. SAMPLE=N: N random mutants
# per module (mutation/sample.py), for a run that fits in an hour.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
work=${MUTATE_DIR:-${TMPDIR:-/tmp}/fsdp_fn-mutate}
bin="$root/.venv/bin"
modules=("$@")
[ ${#modules[@]} -gt 0 ] || modules=(collectives shard plan gather unit runtime sink prefetch step optim)
mkdir -p "$root/mutation/results"
# The sessions (<module>.sqlite) stay in $work across runs; the tree is copied afresh.
mkdir -p "$work" && find "$work" -mindepth 1 -maxdepth 1 ! -name '*.sqlite' -exec rm -rf {} +
(cd "$root" && git ls-files -z | xargs -0 cp -P --parents -t "$work")
ln -s "$root/.venv" "$work/.venv"
cd "$work"
for m in "${modules[@]}"; do
    cfg="mutation/$m.toml"
    db="$work/$m.sqlite"
    "$bin/cosmic-ray" init "$cfg" "$db"
    "$bin/cr-filter-operators" "$db" "$cfg"
    if [ -n "${SAMPLE:-}" ]; then "$bin/python" "$root/mutation/sample.py" "$db" "$SAMPLE"; fi
    "$bin/cosmic-ray" baseline "$cfg"   # the unmutated tests must pass, or every mutant looks killed
    "$bin/cosmic-ray" exec "$cfg" "$db"
    "$bin/cr-report" --show-diff --surviving-only "$db" > "$root/mutation/results/$m.txt" || true
    "$bin/python" "$root/mutation/score.py" "$db" | tee -a "$root/mutation/results/$m.txt"
done
