"""Mutants planted by hand (docs/testing.md, the fifth batch): each a plausible slip in a
core module, applied to a copy of the tracked tree, its tests run with ``pytest -x``.

    python mutation/by_hand.py                    # every mutant
    python mutation/by_hand.py standin_noop       # some, by name

A mutant whose text is not found exactly once is reported and skipped (the code moved).
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORK = pathlib.Path(os.environ.get("MUTATE_DIR", tempfile.gettempdir())) / "fsdp_fn-by-hand"
# (name, file, text, replacement, the tests of its concern)
MUTANTS = [
    (
        "standin_noop",
        "fsdp_fn/_standin.py",
        "            m._parameters[attr] = standins[id(p)]  # type: ignore[assignment]",
        "            pass",
        (
            "tests/test_correctness.py::test_the_modules_own_parameters_read_in_the_loss_raise_naming_one "
            "tests/test_errors.py::test_a_loss_reading_the_modules_own_parameters_in_value_and_grad"
        ),
    ),
    (
        "sync_all_counts",
        "fsdp_fn/_optim.py",
        "    for name in whole:\n        counts = steps[name]",
        "    for name in steps.shards:\n        counts = steps[name]",
        "tests/test_correctness.py::test_a_parameter_skipped_at_an_earlier_step_keeps_its_own_step_count",
    ),
    (
        "no_abandon",
        "fsdp_fn/_grad.py",
        "            runtime.abandon()",
        "            pass",
        (
            "tests/test_errors.py::test_a_loss_fn_that_calls_backward_is_told_so "
            "tests/test_correctness.py::test_without_update_in_backward_a_failed_backward_leaves_the_state_usable"
        ),
    ),
    (
        "no_check_trainable_step",
        "fsdp_fn/_step.py",
        "            state.params.plan.check_trainable(self.fn.module)",
        "            pass",
        "tests/test_correctness.py::test_changing_requires_grad_after_the_plan_raises_and_a_new_plan_trains",
    ),
    (
        "no_check_trainable_grad",
        "fsdp_fn/_grad.py",
        "        params.plan.check_trainable(fn.module)",
        "        pass",
        "tests/test_correctness.py tests/test_errors.py",
    ),
    (
        "fingerprint_ignores_ends",
        "fsdp_fn/_runtime.py",
        "aligned * 257 + ends",
        "aligned",
        (
            "tests/test_correctness.py::test_a_forward_that_changes_its_parameters_in_place_raises_naming_it "
            "tests/test_correctness.py::test_a_fingerprint_sees_a_change_to_any_element"
        ),
    ),
    (
        "no_root_check",
        "fsdp_fn/_runtime.py",
        "            _check_unchanged(ROOT, *root)",
        "            pass",
        "tests/test_correctness.py::test_a_forward_that_changes_its_parameters_in_place_raises_naming_it",
    ),
    (
        "pre_hook_appended",
        "fsdp_fn/_runtime.py",
        "with_kwargs=True, prepend=True))",
        "with_kwargs=True))",
        "tests/test_correctness.py::test_a_unit_that_computes_its_weight_trains_like_one_process",
    ),
    (
        "sparse_overwrite",
        "fsdp_fn/_unit.py",
        "                into.zero_().add_(grad)",
        "                into.copy_(grad.coalesce().to_dense())",
        "tests/test_lookup.py::test_a_sparse_embedding_trains_like_one_process",
    ),
    (
        "sparse_no_zero",
        "fsdp_fn/_unit.py",
        "                into.zero_().add_(grad)",
        "                into.add_(grad)",
        "tests/test_lookup.py::test_a_sparse_embedding_trains_like_one_process",
    ),
    (
        "decay_mask_inverted",
        "fsdp_fn/_optim.py",
        "decays = [True if decay is None else bool(decay(spec.name, spec.shape)) for spec in unit.params]",
        "decays = [True if decay is None else not bool(decay(spec.name, spec.shape)) for spec in unit.params]",
        (
            "tests/test_chain.py "
            "tests/test_features.py::test_a_hugging_face_llama_trains_with_decay_on_matrices_and_a_schedule_like_one_process"
        ),
    ),
    (
        "schedule_off_by_one",
        "fsdp_fn/_optim.py",
        "    return float(lr(grads.step))",
        "    return float(lr(grads.step + 1))",
        "tests/test_chain.py",
    ),
    (
        "accumulate_schedule_raw",
        "fsdp_fn/_transforms.py",
        "grads.step // every  #",
        "grads.step  #",
        "tests/test_chain.py",
    ),
    (
        "no_max_norm_refusal",
        "fsdp_fn/_plan.py",
        "        if isinstance(m, nn.Embedding) and m.max_norm is not None:",
        "        if False:",
        "tests/test_lookup.py::test_an_embedding_with_max_norm_is_refused_naming_it",
    ),
    (
        "aux_not_detached",
        "fsdp_fn/_grad.py",
        "    return torch_pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux)",
        "    return aux",
        "tests/test_chain.py tests/test_correctness.py",
    ),
    (
        "whole_ignores_decay",
        "fsdp_fn/_optim.py",
        "and len(set(decays)) == 1\n",
        "\n",
        (
            "tests/test_chain.py "
            "tests/test_features.py::test_a_hugging_face_llama_trains_with_decay_on_matrices_and_a_schedule_like_one_process"
        ),
    ),
]


def main() -> None:
    only = sys.argv[1:]
    for name, f, old, new, tests in MUTANTS:
        if only and name not in only:
            continue
        work = WORK / name
        shutil.rmtree(work, ignore_errors=True)
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
        for rel in files:
            dst = work / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst)
        src = (work / f).read_text()
        n = src.count(old)
        if n != 1:
            print(f"{name}: pattern found {n} times, skipped", flush=True)
            continue
        (work / f).write_text(src.replace(old, new))
        t0 = time.time()
        r = subprocess.run(
            f"env FSDP_FN_TEST_TIMEOUT=120 {sys.executable} -m pytest -x -q -p no:cacheprovider {tests}",
            shell=True,
            cwd=work,
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(work), "HOME": "/tmp"},
        )
        last = [line for line in r.stdout.splitlines() if line.strip()][-1:]
        failed = [line for line in r.stdout.splitlines() if line.startswith("FAILED")]
        print(
            f"{name}: {'KILLED' if r.returncode else 'SURVIVED'} in {time.time() - t0:.0f}s {failed[:1]} {last}",
            flush=True,
        )


if __name__ == "__main__":
    main()
