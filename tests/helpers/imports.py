"""What a fresh interpreter imports: the probe behind the tests that keep heavy modules
(torch on the driver, pandas on a rank) off a path."""

from __future__ import annotations

import ast
import subprocess
import sys
from typing import Iterable, List


def modules_imported_by(code: str, modules: Iterable[str]) -> List[str]:
    """Which of ``modules`` a new interpreter holds after running ``code`` (sorted)."""
    wanted = tuple(modules)
    # the collector off: what is imported does not depend on it, and its full collections
    # took a quarter of a probe that imports torch (``raytrain_ext.collector``)
    probe = (
        f"import gc\ngc.disable()\n{code}\n"
        f"import sys\nprint(sorted(m for m in {wanted!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])
