"""`python -m demos CONFIG`: build the demo assets a run config names (`model.demo_assets`)."""

from __future__ import annotations

import sys

from cluster.config.schema import ConfigError, load_config
from demos import DemoBuildError, ensure_demo


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m demos CONFIG   (e.g. configs/arithmetic_tiny.yaml)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args[0])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    spec = cfg.model.demo_assets
    if spec is None:
        print(f"{args[0]} names no demo assets (model.demo_assets)")
        return 0
    try:
        print(f"{spec.demo} assets ready in {ensure_demo(spec.demo, spec.folder)}")
    except DemoBuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
