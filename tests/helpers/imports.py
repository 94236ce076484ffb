"""A new interpreter started from a test, and what one imports: the probe behind the tests
that keep heavy modules (torch on the driver, pandas on a rank) off a path."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from typing import Iterable, List, Mapping, Optional


class Interpreter:
    """A new interpreter that runs ``code`` (dedented) with ``env`` added to this process's
    environment, started at once; :meth:`output` waits for it.  Interpreters are
    independent processes: a test module starts all of its own together (a module-scoped
    fixture), so that the cores run them side by side."""

    def __init__(self, code: str, env: Optional[Mapping[str, str]] = None, timeout_s: float = 120):
        self._timeout_s = timeout_s
        self._process = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def output(self) -> str:
        """What it printed (stripped); its error output in the failure when it failed."""
        out, err = self._process.communicate(timeout=self._timeout_s)
        assert self._process.returncode == 0, err
        return out.strip()


class Probe(Interpreter):
    """An :class:`Interpreter` that runs ``code``, then reports which of ``modules`` it holds."""

    def __init__(self, code: str, modules: Iterable[str]):
        wanted = tuple(modules)
        # the collector off: what is imported does not depend on it, and its full
        # collections took a quarter of a probe that imports torch (``raytrain_ext.collector``)
        probe = (
            f"import gc\ngc.disable()\n{code}\n"
            f"import sys\nprint(sorted(m for m in {wanted!r} if m in sys.modules))\n"
        )
        super().__init__(probe, timeout_s=300)

    def modules(self) -> List[str]:
        """Which of the modules the interpreter held after ``code`` (sorted)."""
        return ast.literal_eval(self.output().splitlines()[-1])


def modules_imported_by(code: str, modules: Iterable[str]) -> List[str]:
    """Which of ``modules`` a new interpreter holds after running ``code`` (sorted)."""
    return Probe(code, modules).modules()
