"""A finding: one thing the doctor tells an operator, with how much it matters.

Severities, worst first: ``error`` (this will break or badly slow a job),
``warning`` (likely a problem, check it), ``info`` (worth knowing).  Checks
return plain dicts so reports serialize to JSON unchanged.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional

SEVERITIES = ("error", "warning", "info")


def finding(severity: str, check: str, message: str) -> Dict[str, str]:
    if severity not in SEVERITIES:
        raise ValueError(f"severity {severity!r} must be one of {SEVERITIES}")
    return {"severity": severity, "check": check, "message": message}


def worst(findings: Iterable[Dict[str, str]]) -> Optional[str]:
    """The most severe severity present, or None for no findings."""
    present = {f["severity"] for f in findings}
    return next((s for s in SEVERITIES if s in present), None)
