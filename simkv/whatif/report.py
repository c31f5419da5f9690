"""Pieces of the capacity report (notebooks/capacity_report.ipynb): the knee of a load curve,
differences between configurations judged against their noise, the sentences that say so, and
the report's figures.

Noise: a configuration's capacity is measured on K workload replicates (the same K for every
configuration, so two configurations are compared replicate by replicate) by a search whose
answer is only known to its bracket (`resolution`, relative). Two figures are "no different"
when the 95% t interval of their difference holds 0, or when the difference is within the
resolution. With one replicate only the resolution is known, and the sentence says so.

Figures use matplotlib's object API (no pyplot). Every SLO bound is drawn as a line with
gid "slo", a knee as a marker with gid "knee"; latency axes start at 0 (log only when the
values span more than LOG_SPAN); the legend sits outside the axes, right of them, never over
a title.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np
import pandas as pd

LOG_SPAN = 20.0          # a latency axis goes log when its values span more than this factor
KNEE_MIN_GAP = 0.1       # a knee lies at least this far (normalised units) below the chord


# ----------------------------------------------------------------------------------------------
# The knee of a load curve


def knee_index(x: Sequence[float], y: Sequence[float],
               min_gap: float = KNEE_MIN_GAP) -> Optional[int]:
    """Index of the knee of an increasing, convex curve (latency against offered load), or None.

    Kneedle's rule (Satopää et al., ICDCS workshops 2011) without smoothing: x and y are scaled
    to [0, 1] and the knee is the point farthest below the chord from the first point to the
    last, provided it lies at least `min_gap` below it; a straight or concave curve has none.
    """
    xs = np.asarray(x, dtype=float)
    ys = np.asarray(y, dtype=float)
    keep = np.isfinite(xs) & np.isfinite(ys)
    xs, ys, index = xs[keep], ys[keep], np.flatnonzero(keep)
    if len(xs) < 3:
        return None
    order = np.argsort(xs, kind="stable")
    xs, ys, index = xs[order], ys[order], index[order]
    dx, dy = xs[-1] - xs[0], ys[-1] - ys[0]
    if dx <= 0 or dy <= 0:
        return None
    gap = (xs - xs[0]) / dx - (ys - ys[0]) / dy
    best = int(np.argmax(gap))
    return int(index[best]) if gap[best] >= min_gap else None


# ----------------------------------------------------------------------------------------------
# Differences and their noise


def t_quantile_975(dof: int) -> float:
    """Two-sided 95% Student t quantile for `dof` >= 1 degrees of freedom."""
    from scipy import stats

    return float(stats.t.ppf(0.975, dof))


@dataclass(frozen=True)
class Difference:
    """a − b: its mean, a 95% interval (None with one replicate) and the resolution."""

    a_mean: float
    b_mean: float
    mean: float
    low: Optional[float]
    high: Optional[float]
    resolution: float           # absolute: differences this small cannot be told apart
    replicates: int

    @property
    def within_noise(self) -> bool:
        if abs(self.mean) <= self.resolution:
            return True
        return self.low is not None and self.low <= 0 <= self.high


def difference(a: Sequence[float], b: Sequence[float], *, paired: bool = True,
               resolution: float = 0.0) -> Difference:
    """a − b over replicates. `paired`: replicate k of a and of b ran on the same workload, so
    the interval is the t interval of the K differences; otherwise Welch's. `resolution` is
    relative to the larger mean (a search tolerance)."""
    av, bv = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if paired and len(av) != len(bv):
        raise ValueError(f"paired difference of {len(av)} and {len(bv)} replicates")
    a_mean, b_mean = float(av.mean()), float(bv.mean())
    mean = a_mean - b_mean
    absolute = resolution * max(abs(a_mean), abs(b_mean))
    k = min(len(av), len(bv))
    if k < 2:
        return Difference(a_mean, b_mean, mean, None, None, absolute, k)
    if paired:
        d = av - bv
        half = t_quantile_975(k - 1) * float(d.std(ddof=1)) / math.sqrt(k)
    else:
        va, vb = av.var(ddof=1) / len(av), bv.var(ddof=1) / len(bv)
        se = math.sqrt(va + vb)
        if se == 0:
            half = 0.0
        else:
            dof = (va + vb) ** 2 / (va ** 2 / (len(av) - 1) + vb ** 2 / (len(bv) - 1))
            half = t_quantile_975(max(1, int(dof))) * se
    return Difference(a_mean, b_mean, mean, mean - half, mean + half, absolute, k)


def _fmt(value: float) -> str:
    """Three significant digits, thousands written out (4,680 rather than 4.68e+03)."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _signed(value: float) -> str:
    return ("+" if value >= 0 else "-") + _fmt(abs(value))


def _evidence(d: Difference, unit: str) -> str:
    parts = [f"difference {_signed(d.mean)} {unit}"]
    if d.low is not None:
        parts.append(f"95% interval {_signed(d.low)} to {_signed(d.high)} over "
                     f"{d.replicates} replicates")
    else:
        parts.append("one replicate, so workload noise is not measured")
    if d.resolution > 0:
        parts.append(f"search resolution ±{_fmt(d.resolution)}")
    return ", ".join(parts)


def compare_sentence(name_a: str, a: Sequence[float], name_b: str, b: Sequence[float], *,
                     what: str, unit: str, resolution: float = 0.0, paired: bool = True) -> str:
    """One sentence comparing a figure of two configurations: "no difference within noise"
    when `difference` says so, else which is higher and by how much (relative to b)."""
    d = difference(a, b, paired=paired, resolution=resolution)
    values = f"{name_a} {_fmt(d.a_mean)}, {name_b} {_fmt(d.b_mean)} {unit}"
    if d.within_noise:
        return (f"{what}: no difference within noise between {name_a} and {name_b} "
                f"({values}; {_evidence(d, unit)}).")
    word = "higher" if d.mean > 0 else "lower"
    rel = f" ({abs(d.mean) / abs(d.b_mean):.0%})" if d.b_mean else ""
    return (f"{what}: {name_a} is {word} than {name_b} by {_fmt(abs(d.mean))} {unit}{rel} "
            f"({values}; {_evidence(d, unit)}).")


def leaders(values: Mapping[str, Sequence[float]], *, higher_is_better: bool = True,
            resolution: float = 0.0, paired: bool = True) -> list[str]:
    """The configurations tied for the best mean: the best one and every one whose difference
    from it is within noise (`difference`), best first."""
    sign = 1.0 if higher_is_better else -1.0
    ranked = sorted(values, key=lambda k: -sign * float(np.mean(values[k])))
    best = ranked[0]
    return [best] + [k for k in ranked[1:]
                     if difference(values[best], values[k], paired=paired,
                                   resolution=resolution).within_noise]


def ranking_sentence(values: Mapping[str, Sequence[float]], *, what: str, unit: str,
                     higher_is_better: bool = True, resolution: float = 0.0,
                     paired: bool = True) -> str:
    """Which configuration has the best figure, or that the best ones do not differ within
    noise (never a winner among ties)."""
    if len(values) < 2:
        (name, v), = values.items()
        return f"{what}: {name} {_fmt(float(np.mean(v)))} {unit} (one configuration)."
    top = leaders(values, higher_is_better=higher_is_better, resolution=resolution,
                  paired=paired)
    means = ", ".join(f"{k} {_fmt(float(np.mean(values[k])))}" for k in top)
    best_word = "highest" if higher_is_better else "lowest"
    if len(top) == len(values):
        return (f"{what}: no difference within noise between any of the configurations "
                f"({means} {unit}).")
    if len(top) > 1:
        return (f"{what}: {', '.join(top[:-1])} and {top[-1]} share the {best_word} figure, "
                f"with no difference within noise between them ({means} {unit}).")
    runner = [k for k in values if k != top[0]]
    second = max(runner, key=lambda k: (1 if higher_is_better else -1) * float(np.mean(values[k])))
    return (f"{what}: {top[0]} has the {best_word} figure ({means} {unit}); "
            + compare_sentence(top[0], values[top[0]], second, values[second], what="against the next",
                               unit=unit, resolution=resolution, paired=paired))


# ----------------------------------------------------------------------------------------------
# Figures


def _figure(panels: int, title: str, width: float = 4.3, height: float = 3.3):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * panels + 1.6, height), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False).ravel()
    fig.suptitle(title)
    return fig, axes


def _legend(fig, axes) -> None:
    """One legend for the figure, outside the axes on the right (no entry twice)."""
    handles, labels = {}, {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if not label.startswith("_") and label not in labels:
                handles[label], labels[label] = h, label
    if handles:
        fig.legend(list(handles.values()), list(labels), loc="outside right upper", fontsize=8)


def latency_axis(ax, values: Sequence[float], bounds: Sequence[float] = ()) -> None:
    """y from 0 to a little above the largest value or bound; log when the values span more
    than LOG_SPAN (an overloaded point beside healthy ones), so that no small change is
    stretched to fill the axis."""
    pool = [float(v) for v in [*values, *bounds] if v is not None and np.isfinite(v) and v > 0]
    if not pool:
        ax.set_ylim(bottom=0)
        return
    if max(pool) > LOG_SPAN * min(pool):
        ax.set_yscale("log")
        ax.set_ylim(min(pool) / 1.5, max(pool) * 1.5)
    else:
        ax.set_ylim(0, max(pool) * 1.15)


def slo_line(ax, bound: float, label: str, *, vertical: bool = False) -> None:
    line = ax.axvline if vertical else ax.axhline
    line(bound, color="black", linestyle="--", linewidth=1, gid="slo", label=label)


def plot_load_curves(load: pd.DataFrame, *, slo: Mapping[str, float], attainment: float,
                     title: str = "latency and SLO attainment against offered load"):
    """Figure: TTFT p90, TPOT p90 (s) and SLO attainment against offered load (requests/s), one
    line per configuration, the scenario's SLO bounds and the attainment target as lines, and
    each configuration's knee of its TTFT p90 curve marked. `load` columns: configuration,
    rate_rps, ttft_s.p90, tpot_s.p90, slo_attainment. Returns (figure, {configuration: the
    knee's rate or None})."""
    def bounds(*keys):
        return [(k, slo[k]) for k in keys if slo.get(k) is not None]

    panels = [("ttft_s.p90", "TTFT p90 (s)", bounds("ttft_s", "ttft_p90_s")),
              ("tpot_s.p90", "TPOT p90 (s)", bounds("tpot_s", "tpot_p90_s")),
              ("slo_attainment", "requests meeting every SLO", [("attainment", attainment)])]
    fig, axes = _figure(len(panels), title)
    knees: dict = {}
    for ax, (metric, label, lines) in zip(axes, panels):
        present = metric in load.columns
        for i, (name, sub) in enumerate(load.groupby("configuration", sort=False)):
            if not present:
                continue
            sub = sub.sort_values("rate_rps")
            x, y = sub["rate_rps"].to_numpy(float), pd.to_numeric(sub[metric]).to_numpy(float)
            ax.plot(x, y, "-o", color=f"C{i}", markersize=4, label=name)
            if metric == "ttft_s.p90":
                k = knee_index(x, y)
                knees[name] = None if k is None else float(x[k])
                if k is not None:
                    ax.plot(x[k], y[k], marker="D", markersize=9, markerfacecolor="none",
                            markeredgecolor=f"C{i}", linestyle="none", gid="knee",
                            label="knee of TTFT p90 (Kneedle)")
        for key, bound in lines:
            text = (f"target: {bound:.0%} of requests" if key == "attainment"
                    else f"SLO {key} ≤ {bound:g} s")
            slo_line(ax, bound, text)
        if metric == "slo_attainment":
            ax.set_ylim(0, 1.02)
        elif present:
            latency_axis(ax, pd.to_numeric(load[metric]).tolist(), [b for _, b in lines])
        ax.set_xlim(0, float(load["rate_rps"].max()) * 1.05)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_title(label if present else f"{label}: not computed", fontsize=10)
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    return fig, knees


def plot_capacity(table: pd.DataFrame, *, title: str = "capacity per configuration"):
    """Figure: each configuration's capacity on every replicate (dots), the 95% interval of
    their mean (bar) and the planning rate (diamond), on an axis from 0 requests/s. `table`:
    configuration, replicates (list of rates), ci_low, ci_high, planning_rps."""
    fig, (ax,) = _figure(1, title, width=6.5, height=0.6 * len(table) + 1.8)
    for i, row in enumerate(table.itertuples(index=False)):
        y = len(table) - 1 - i
        rates = list(row.replicates)
        ax.plot(rates, [y] * len(rates), "o", color=f"C{i}", alpha=0.7,
                label="replicate" if i == 0 else "_")
        if row.ci_low is not None and not pd.isna(row.ci_low):
            ax.plot([row.ci_low, row.ci_high], [y, y], "-", color=f"C{i}", linewidth=3,
                    alpha=0.5, gid="interval", label="95% interval of the mean" if i == 0 else "_")
        ax.plot([row.planning_rps], [y], "D", color="black", markersize=6,
                label="planning rate" if i == 0 else "_")
    ax.set_yticks(range(len(table)), labels=list(table["configuration"])[::-1])
    top = max(max(r) for r in table["replicates"])
    ax.set_xlim(0, top * 1.15)
    ax.set_ylim(-0.6, len(table) - 0.4)
    ax.set_xlabel("highest rate meeting the SLOs (requests/s)")
    ax.grid(alpha=0.3, axis="x")
    _legend(fig, [ax])
    return fig


def plot_cdfs(requests: Mapping[str, pd.DataFrame], *, slo: Mapping[str, float],
              title: str = "TTFT and TPOT distributions"):
    """Figure: empirical CDFs of TTFT and TPOT (s) of the completed requests of each
    configuration, the SLO bounds as vertical lines; x from 0 to the larger of the largest
    p99 and 1.5 × the bound (log from a tenth of the smallest median when the largest p99 is
    more than LOG_SPAN times the smallest median)."""
    columns = [("ttft_s", "TTFT (s)"), ("tpot_s", "TPOT (s)")]
    fig, axes = _figure(len(columns), title)
    for ax, (col, label) in zip(axes, columns):
        p99s, p50s = [], []
        for i, (name, df) in enumerate(requests.items()):
            values = np.sort(pd.to_numeric(
                df.loc[df["status"] == "completed", col], errors="coerce").dropna().to_numpy())
            if not len(values):
                continue
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post",
                    color=f"C{i}", label=name)
            p99s.append(float(np.quantile(values, 0.99)))
            p50s.append(max(float(np.quantile(values, 0.5)), 1e-9))
        key = next((k for k in (col, col.replace("_s", "_p90_s")) if slo.get(k) is not None),
                   None)
        if key is not None:
            slo_line(ax, slo[key], f"SLO {key} ≤ {slo[key]:g} s", vertical=True)
        bound = slo.get(key) if key else None
        right = max(p99s + ([1.5 * bound] if bound else []), default=1.0)
        if p99s and max(p99s) > LOG_SPAN * min(p50s):
            # an overloaded configuration beside healthy ones: log x, so both stay readable
            ax.set_xscale("log")
            ax.set_xlim(min(p50s) / 10, right * 1.5)
        else:
            ax.set_xlim(0, right)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel(label + (" (cut at the largest p99)" if p99s and right == max(p99s) else ""))
        ax.set_ylabel("fraction of completed requests")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    return fig


def plot_time_series(steps: Mapping[str, pd.DataFrame], *,
                     title: str = "KV cache, queue and running sequences over time"):
    """Figure: KV utilisation (used / all blocks, 0-1), waiting and running requests against
    simulated time (s), one line per configuration, every axis from 0."""
    panels = [("kv", "KV blocks in use (fraction)"), ("num_waiting", "requests waiting"),
              ("num_running", "sequences running")]
    fig, axes = _figure(len(panels), title)
    for ax, (col, label) in zip(axes, panels):
        for i, (name, df) in enumerate(steps.items()):
            if col == "kv":
                used = df["kv_blocks_used"].to_numpy(float)
                y = used / (used + df["kv_blocks_free"].to_numpy(float))
            else:
                y = df[col].to_numpy(float)
            ax.step(df["start_s"], y, where="post", color=f"C{i}", linewidth=1, label=name)
        ax.set_ylim(0, 1.02 if col == "kv" else None)
        if col != "kv":
            ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        ax.set_xlabel("simulated time (s)")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    return fig


def save(fig, path) -> str:
    """Write the figure (PNG; the format from the suffix) and return the path as a string."""
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, metadata={"Date": None} if path.suffix == ".svg" else None)
    return str(path)


def figure_lines(fig, gid: str) -> list:
    """Every line of `fig` with this gid ("slo", "knee", "capacity"): for tests and checks."""
    return [line for ax in fig.axes for line in ax.lines if line.get_gid() == gid]


def describe_figures(figures: Mapping[str, object]) -> dict:
    """{name: {"slo_lines", "knees", "axes"}}: what each figure draws, as plain data."""
    return {name: {"slo_lines": len(figure_lines(fig, "slo")),
                   "knees": len(figure_lines(fig, "knee")),
                   "axes_legends": sum(ax.get_legend() is not None for ax in fig.axes),
                   "figure_legends": len(fig.legends)}
            for name, fig in figures.items()}

