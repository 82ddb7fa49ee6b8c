"""`python tests/held_train.py RELEASE CONFIG [cluster.train's arguments]`: `cluster.train` with the learner
held (`learner_gate`) until the file RELEASE exists, while rollouts go on up to the staleness bound.
Every chunk scored in the meantime is then certainly unread by the learner, whatever the machine's
speed (tests/test_multinode.py). Says once, on stdout, that it holds."""

from __future__ import annotations

import sys
from pathlib import Path

from cluster.train import main


def held_until(release: Path):
    said = []

    def gate() -> bool:
        if release.exists():
            return False
        if not said:
            said.append(True)
            print(f"learner held until {release} exists", flush=True)
        return True

    return gate


if __name__ == "__main__":
    sys.exit(main(sys.argv[2:], learner_gate=held_until(Path(sys.argv[1]))))
