"""Regenerate the parity table of docs/testing.md from the parity tests' own runs.

Runs the configurations of ``tests/test_parity.py`` (the same ``_train``: 5 steps, global
batch 12, against the unsharded reference in one process) on gloo ranks and prints, per
run, the largest difference to the reference: loss and gradient norm (relative),
parameters (absolute) and, beside it, the largest parameter update, for scale. The
tolerances in ``tests/test_parity.py`` are a few times the column maxima.

    python bench/parity_table.py            # print the table (CPU, gloo; about a minute)
    python bench/parity_table.py --write    # and replace it in docs/testing.md
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import re
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fsdp_fn.testing import RankPool
from tests.test_parity import OPTIONS, _against_fsdp2, _train

BEGIN, END = "<!-- parity table: python bench/parity_table.py --write -->", "<!-- end of parity table -->"


def runs() -> list[tuple[str, str, int, str, dict]]:
    """(label, model, W, optimizer, options) for every parity configuration."""
    out = []
    for kind in ("mlp", "gpt"):
        for world in (1, 2, 3, 4):
            out.append((f"{kind.upper()}, AdamW", kind, world, "adamw", {}))
    for opt in ("sgd", "sgd_dampened", "torch_adam"):
        out.append((f"MLP, {opt}", "mlp", 3, opt, {}))
        out.append((f"MLP, {opt}, update in backward", "mlp", 2, opt, OPTIONS["update_in_backward"]))
    for option in sorted(OPTIONS):
        for world in (2, 3):
            out.append((f"GPT, AdamW, {option}", "gpt", world, "adamw", OPTIONS[option]))
    out.append(("GPT tied, AdamW", "gpt", 3, "adamw", {"tie": True}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="replace the table in docs/testing.md")
    args = parser.parse_args()
    lines = [
        "| run | W | loss (max rel.) | grad norm (max rel.) | parameters (max abs.) | largest update |",
        "|---|---|---|---|---|---|",
    ]
    with RankPool(4) as pool:
        for label, kind, world, opt, options in runs():
            f = pool.run(_train, kind, opt, world=world, **options)[0]
            lines.append(
                f"| {label} | {world} | {f['loss']:.1e} | {f['grad_norm']:.1e} | {f['param']:.1e} | {f['update']:.1e} |"
            )
            print(lines[-1], flush=True)
        for world in (2, 3):
            f = pool.run(_against_fsdp2, world=world)[0]
            lines.append(
                f"| GPT against torch FSDP2 | {world} | {f['loss']:.1e} | {f['grad_norm']:.1e} "
                f"| {f['param']:.1e} | {f['update']:.1e} |"
            )
            print(lines[-1], flush=True)
    where = f"Platform: {platform.machine()} CPU, gloo, torch {torch.__version__}."
    table = "\n".join([BEGIN, *lines, "", where, END])
    if args.write:
        page = ROOT / "docs" / "testing.md"
        text = page.read_text()
        if BEGIN not in text:
            raise SystemExit(f"{page} has no '{BEGIN}' marker")
        page.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: table, text, flags=re.S))
        print(f"wrote {page}")


if __name__ == "__main__":
    main()
