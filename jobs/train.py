"""Entrypoint for `ray job submit -- python jobs/train.py --config CONFIG.yaml key=value ...`.

Identical to `raytrain-ext train`; inside a Ray job, RAY_ADDRESS points at the cluster.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from raytrain_ext.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
