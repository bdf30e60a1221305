"""``python -m benchmarks.hf_coverage``: run the coverage matrix and write its page (see the package docstring)."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from benchmarks.hf_coverage import cells, table
from benchmarks.hf_coverage.run import DOCS, run_matrix, write_docs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_coverage", description=__doc__)
    parser.add_argument("--families", help="comma-separated model types (default: all)")
    parser.add_argument("--layouts", default=",".join(table.COLUMNS), help="comma-separated, of " +
                        ", ".join(table.COLUMNS))
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<date>/hf_coverage)")
    parser.add_argument("--docs", type=Path, help="markdown page to write (default docs/hf-coverage.md for a full "
                        "run; none for a subset)")
    parser.add_argument("--cell-timeout", type=float, default=cells.CELL_TIMEOUT, help="seconds per cell")
    parser.add_argument("--resume", action="store_true", help="keep the cells already saved in the results folder")
    parser.add_argument("--optimizers", default="sgd,adamw", help="comma-separated: sgd (every column), adamw (the "
                        "plain columns again, judged against their floors)")
    args = parser.parse_args(argv)
    layouts = tuple(name for name in args.layouts.split(",") if name)
    unknown = sorted(set(layouts) - set(table.COLUMNS))
    if unknown:
        parser.error(f"unknown layouts {unknown}: use {', '.join(table.COLUMNS)}")
    selected = args.families.split(",") if args.families else None
    optimizers = tuple(name for name in args.optimizers.split(",") if name)
    if not set(optimizers) <= {"sgd", "adamw"} or not optimizers:
        parser.error(f"--optimizers {args.optimizers!r}: use sgd, adamw or sgd,adamw")
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    result = run_matrix(selected, layouts, args.out, args.cell_timeout, resume=args.resume, optimizers=optimizers)
    for layout, row in result.get("summary", {}).items():
        if row["families"]:
            print(f"{table.COLUMNS[layout]:>29}: {row['PARITY']}/{row['families']} PARITY "
                  f"({100 * row['parity_share']:.0f}%), {row['REFUSED']} refused, {row['DEFECT']} defects")
    for layout, row in result.get("adamw", {}).get("summary", {}).items():
        if row["families"]:
            print(f"{table.COLUMNS[layout] + ' (AdamW)':>29}: {row['PARITY']}/{row['families']} PARITY, "
                  f"{row['FLOOR']} at the floor, {row['REFUSED']} refused, {row['DEFECT']} defects")
    full = selected is None and layouts == tuple(table.COLUMNS) and optimizers == ("sgd", "adamw")
    docs = args.docs or (DOCS if full else None)
    if docs is not None:
        write_docs(result, docs)
        print(f"wrote {docs}")


if __name__ == "__main__":
    main()
