"""Every attempt of a run, for its report: the run's ``summary.json`` describes one
attempt (the newest that trained), while ``attempts/NNN/`` keeps each ``fit()``'s own
summary, a failed one with its error line and the path of its full log (``run_dir``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

NO_SUMMARY = "no summary (killed, or still running)"


def attempt_rows(run_dir: Path) -> List[Dict[str, Any]]:
    """One row per attempt directory, in attempt order; one whose summary.json is missing or
    unreadable is shown by its number and that fact."""
    rows = []
    attempts = Path(run_dir) / "attempts"
    numbered = sorted(
        (p for p in attempts.glob("*") if p.name.isdigit()), key=lambda p: int(p.name)
    )
    for directory in numbered:
        try:
            summary = json.loads((directory / "summary.json").read_text())
        except (OSError, ValueError):
            summary = {"status": NO_SUMMARY}
        rows.append(
            {
                "attempt": int(directory.name),
                "status": summary.get("status", NO_SUMMARY),
                "steps": summary.get("steps_completed"),
                "error": summary.get("error"),
                "error_log": summary.get("error_log"),
            }
        )
    return rows


def attempts_section(rows: List[Dict[str, Any]]) -> List[str]:
    """The report's Markdown table of ``rows`` (nothing for a run with no attempt records)."""
    if not rows:
        return []
    lines = [
        "## Attempts",
        "",
        "| attempt | status | steps | error (full log) |",
        "|---|---|---|---|",
    ]
    for row in rows:
        error = ""
        if row["error"]:
            error = f"{row['error']} ({row['error_log']})".replace("|", "\\|").replace("\n", " ")
        steps = "n/a" if row["steps"] is None else row["steps"]
        lines.append(f"| attempt {row['attempt']} | {row['status']} | {steps} | {error} |")
    return lines


def failed(rows: List[Dict[str, Any]]) -> List[int]:
    """The attempts that ended in an error."""
    return [row["attempt"] for row in rows if row["status"] == "failed"]
