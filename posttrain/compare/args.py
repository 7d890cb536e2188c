"""``posttrain compare``'s command-line arguments, apart from the comparison itself (``compare.py``), so that
building the CLI's parser imports no torch or transformers (``posttrain --help`` answers at once).
"""

from __future__ import annotations

import argparse


def add_compare_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``posttrain compare`` to the CLI's subcommands (dispatch with ``posttrain.compare.run.cli_compare``)."""
    p = sub.add_parser(
        "compare",
        help="several recipes (or override sets) over several seeds: summary table and overlaid report",
        description="Runs every recipe (or every --variant of one recipe) on the same seeds with the same "
        "common overrides, resuming incomplete runs, then writes OUT/summary.{md,json} and OUT/report.html. "
        "Put the dotted overrides before the options.",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="RECIPE_OR_OVERRIDE",
        help="recipes (*.toml) to compare, and dotted overrides for every run (e.g. train.steps=100)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="'[LABEL:] KEY=VALUE ...'",
        help="one compared set of overrides of the (single) recipe; repeat it; '' is the recipe as is",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of every arm (default: 0)")
    p.add_argument("--out", default="runs/compare", help="compare directory (default: runs/compare)")
    p.add_argument("--parallel", type=int, default=1, help="train processes at once (default: 1)")
    p.add_argument("--target", type=float, help="report the steps each run took to reach this eval pass@1")
    p.add_argument("--title", help="title of the table and the report")
    p.add_argument("--no-report", action="store_true", help="write the table only, not report.html")
    return p
