"""The report's figure: loss, throughput and world size over wall time, each recovery
marked (``raytrain-ext report`` writes it as ``report.png``).

matplotlib is imported inside :func:`plot_run`, so reading a run never imports it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from raytrain_ext.ops.run_series import RunSeries, recovery_phases, run_series, world_size_changes


def plot_run(summary: Dict[str, Any], tokens_per_step: Optional[int] = None):
    """The report figure: loss (top) and throughput with world size (bottom) over wall time.

    Each recovery is a red span from the last good step to the first step after
    it, with a dashed line where the controller detected the failure; the legend
    below the plots names its reason.  A line breaks (NaN) wherever the step
    count goes back, so no segment is drawn across a recovery.  Returns the
    matplotlib ``Figure`` (no pyplot, so no global state).
    """
    from matplotlib.figure import Figure

    series = run_series(summary, tokens_per_step)
    time_s = _break_where_steps_go_back(series.time_s, series.steps)
    fig = Figure(figsize=(10, 7), layout="constrained")
    ax_loss, ax_rate = fig.subplots(2, 1, sharex=True)
    ax_loss.plot(
        time_s, _break_where_steps_go_back(series.loss, series.steps), marker=".", label="loss"
    )
    _plot_eval(ax_loss, summary)
    ax_loss.set_ylabel("loss")
    ax_rate.plot(
        time_s,
        _break_where_steps_go_back(series.throughput, series.steps),
        marker=".",
        color="tab:green",
        label=series.throughput_unit,
    )
    ax_rate.set_ylabel(series.throughput_unit)
    ax_rate.set_xlabel("wall time since start (s)")
    twin = _plot_world_size(ax_rate, summary, series)
    for number, phase in enumerate(recovery_phases(summary), 1):
        _mark_recovery(ax_loss, ax_rate, number, phase)
    fig.suptitle(
        f"{summary.get('run_name', 'run')}: {summary.get('status', '?')}, "
        f"{summary.get('steps_completed', 0)} steps, "
        f"recoveries: {len(summary.get('recoveries', []))}"
    )
    handles = [
        h
        for ax in (ax_loss, ax_rate, twin)
        if ax is not None
        for h in ax.get_legend_handles_labels()[0]
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize="small")
    ax_loss.grid(alpha=0.3)
    ax_rate.grid(alpha=0.3)
    return fig


def _plot_eval(ax_loss, summary: Dict[str, Any]) -> None:
    """Evaluation losses as points on the loss axis, at the wall time of their step."""
    ends = dict((step, t - summary["started_at"]) for step, t in summary["step_end_times"])
    points = [(ends.get(e["step"]), e["eval_loss"]) for e in summary.get("eval_history", [])]
    points = [(t, loss) for t, loss in points if t is not None]
    if points:
        ax_loss.plot(*zip(*points, strict=True), "s", color="tab:orange", label="eval loss")


def _break_where_steps_go_back(values: List[float], steps: List[int]) -> List[float]:
    """``values`` with a NaN inserted before each record whose step is not after the previous."""
    out: List[float] = []
    for i, value in enumerate(values):
        if i and steps[i] <= steps[i - 1]:
            out.append(float("nan"))
        out.append(value)
    return out


def _plot_world_size(ax, summary: Dict[str, Any], series: RunSeries):
    changes = world_size_changes(summary)
    if not changes:
        return None
    twin = ax.twinx()
    end = max([summary.get("wall_time_s", 0.0), *series.time_s, changes[-1][0]])
    times = [at for at, _ in changes] + [end]
    sizes = [size for _, size in changes] + [changes[-1][1]]
    twin.step(times, sizes, where="post", color="tab:gray", linestyle=":", label="world size")
    twin.set_ylabel("world size")
    twin.set_ylim(0, max(sizes) + 1)
    twin.yaxis.get_major_locator().set_params(integer=True)
    return twin


def _mark_recovery(ax_loss, ax_rate, number: int, phase: Dict[str, Any]) -> None:
    detected = phase["at_s"]
    begin = detected - (phase["detect_s"] or 0.0)
    reason = phase["reason"] if len(phase["reason"]) <= 70 else phase["reason"][:67] + "..."
    label = f"recovery {number} at {detected:.1f} s: {reason}"
    for ax in (ax_loss, ax_rate):
        if phase["mttr_s"] is not None:
            ax.axvspan(
                begin,
                begin + phase["mttr_s"],
                color="tab:red",
                alpha=0.12,
                gid=f"recovery-{number}-span",
            )
        ax.axvline(
            detected,
            color="tab:red",
            linestyle="--",
            linewidth=1,
            gid=f"recovery-{number}",
            label=label if ax is ax_loss else None,
        )
