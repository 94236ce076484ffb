"""What a fresh interpreter imports: the probe behind the tests that keep heavy modules
(torch on the driver, pandas on a rank) off a path."""

from __future__ import annotations

import ast
import subprocess
import sys
from typing import Iterable, List


class Probe:
    """A new interpreter that runs ``code``, started at once; :meth:`modules` waits for it.
    Probes are independent processes: a test module starts all of its own together (a
    module-scoped fixture), so that the cores run them side by side."""

    def __init__(self, code: str, modules: Iterable[str]):
        wanted = tuple(modules)
        # the collector off: what is imported does not depend on it, and its full
        # collections took a quarter of a probe that imports torch (``raytrain_ext.collector``)
        probe = (
            f"import gc\ngc.disable()\n{code}\n"
            f"import sys\nprint(sorted(m for m in {wanted!r} if m in sys.modules))\n"
        )
        self._args = [sys.executable, "-c", probe]
        self._process = subprocess.Popen(
            self._args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def modules(self) -> List[str]:
        """Which of the modules the interpreter held after ``code`` (sorted)."""
        out, err = self._process.communicate(timeout=300)
        if self._process.returncode != 0:
            raise subprocess.CalledProcessError(self._process.returncode, self._args, out, err)
        return ast.literal_eval(out.strip().splitlines()[-1])


def modules_imported_by(code: str, modules: Iterable[str]) -> List[str]:
    """Which of ``modules`` a new interpreter holds after running ``code`` (sorted)."""
    return Probe(code, modules).modules()
