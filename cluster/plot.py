"""`python -m cluster.plot RUN_DIR [--out FILE]`: a PNG of a run's curves from its metrics.jsonl
(`cluster.reporting.curves`). Needs matplotlib (`pip install -e '.[plot]'`)."""

from __future__ import annotations

import argparse
import sys

from cluster.reporting.curves import plot_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster.plot", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", help="a run folder (holds metrics.jsonl)")
    ap.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/curves.png)")
    args = ap.parse_args(argv)
    try:
        out = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
