"""Plots of a sweep frame (sweep.csv) that answer the capacity questions, as PNG and SVG.

- block-size study: per memory budget (one line each), block size against KV utilisation,
  internal fragmentation, concurrency (peak and mean), preemptions, TTFT p90 and goodput;
- paged vs contiguous at equal budget, and swap vs recompute: grouped bars per setting.

Figures are built with matplotlib's object API (no pyplot, no GUI backend; saving renders with
Agg), so importing this module never changes a notebook's backend.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd

BLOCK_SIZE = "cache.block_size"
BUDGET = "cache.memory_budget_gib"
ALLOCATOR = "cache.allocator"
PREEMPTION = "cache.preemption_mode"

LABELS = {
    "kv_utilization_mean": "KV utilisation (mean)",
    "kv_utilization_peak": "KV utilisation (peak)",
    "internal_fragmentation_mean": "internal fragmentation (mean)",
    "running_peak": "concurrent sequences (peak)",
    "running_mean": "concurrent sequences (mean)",
    "preemptions": "preemptions",
    "ttft_s.p90": "TTFT p90 (s)",
    "tpot_s.p90": "TPOT p90 (s)",
    "e2e_s.p90": "end-to-end p90 (s)",
    "goodput_requests_per_s": "goodput (requests/s)",
    "throughput_requests_per_s": "throughput (requests/s)",
    "throughput_output_tokens_per_s": "output tokens/s",
    "recomputed_tokens": "recomputed tokens",
    "swapped_out_blocks": "blocks swapped out",
    "requests_rejected": "requests rejected",
}
BLOCK_SIZE_PANELS = [["kv_utilization_mean"], ["internal_fragmentation_mean"],
                     ["running_peak", "running_mean"], ["preemptions"], ["ttft_s.p90"],
                     ["goodput_requests_per_s"]]
PAGED_VS_CONTIGUOUS = ["running_mean", "running_peak", "kv_utilization_mean",
                       "internal_fragmentation_mean", "preemptions", "ttft_s.p90"]
SWAP_VS_RECOMPUTE = ["preemptions", "recomputed_tokens", "swapped_out_blocks", "ttft_s.p90",
                     "tpot_s.p90", "throughput_output_tokens_per_s"]


def _figure(panels: int, title: str):
    from matplotlib.figure import Figure

    cols = 3 if panels > 4 else panels
    rows = -(-panels // cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[panels:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, axes


def _save(fig, out_dir: Path, name: str, formats: tuple) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out_dir / f"{name}.{fmt}"
        fig.savefig(path, dpi=90, metadata={"Date": None} if fmt == "svg" else None)
        paths.append(path)
    return paths


def _label(row: pd.Series, keys: list[str]) -> str:
    """The values of `keys` in a row, for a legend entry or a tick ("20, 16")."""
    return ", ".join(f"{row[k]:g}" if isinstance(row[k], float) else str(row[k])
                     for k in keys) or "all"


def _title(keys: list[str]) -> str:
    """Legend or axis title naming the keys of `_label` ("memory_budget_gib, block_size")."""
    return ", ".join(k.rsplit(".", 1)[-1] for k in keys)


def _groups(df: pd.DataFrame, keys: list[str]):
    """(label, sub-frame) per combination of `keys`, in order of appearance."""
    if not keys:
        yield "all", df
        return
    for _, sub in df.groupby(keys, sort=False):
        yield _label(sub.iloc[0], keys), sub


def _metric(df: pd.DataFrame, metric: str) -> Optional[pd.Series]:
    """The column as numbers, or None when the sweep has no such column (goodput without SLOs)."""
    return pd.to_numeric(df[metric], errors="coerce") if metric in df.columns else None


def _log_if_wide(ax, df: pd.DataFrame, metric: str) -> None:
    """Latencies spanning more than 20× (an overloaded point beside healthy ones): log y axis."""
    values = _metric(df, metric)
    if metric.endswith(("_s.p90", "_s.p99", "_s.p50", "_s.mean")) and values is not None:
        values = values[values > 0]
        if len(values) and values.max() > 20 * values.min():
            ax.set_yscale("log")


def plot_block_size_study(df: pd.DataFrame, out_dir: str | Path, *,
                          hue: Optional[list[str]] = None, name: str = "block_size_study",
                          formats: tuple = ("png", "svg"), title: str = "") -> list[Path]:
    """Block size (x, log2) against the BLOCK_SIZE_PANELS metrics, one line per `hue` group
    (default: the memory budget when the frame has one). Returns the written files."""
    hue = [BUDGET] if hue is None and BUDGET in df.columns else (hue or [])
    fig, axes = _figure(len(BLOCK_SIZE_PANELS), title or "block size study")
    for ax, metrics in zip(axes, BLOCK_SIZE_PANELS):
        for i, (label, sub) in enumerate(_groups(df, hue)):
            sub = sub.sort_values(BLOCK_SIZE)
            for metric, style in zip(metrics, ("-o", "--s")):
                values = _metric(sub, metric)
                if values is None:
                    continue
                ax.plot(sub[BLOCK_SIZE], values, style, color=f"C{i}", markersize=4,
                        label=label if metric == metrics[0] else None)
        ax.set_xscale("log", base=2)
        _log_if_wide(ax, df, metrics[0])
        ax.set_xticks(sorted(df[BLOCK_SIZE].unique()), labels=[
            str(int(b)) for b in sorted(df[BLOCK_SIZE].unique())])
        ax.set_xlabel("block size (tokens)")
        if metrics == ["running_peak", "running_mean"]:
            heading = "running sequences: peak (solid), mean (dashed)"
        elif metrics[0] in df.columns:
            heading = LABELS.get(metrics[0], metrics[0])
        else:
            heading = f"{LABELS.get(metrics[0], metrics[0])}: not in the sweep (no SLOs)"
        ax.set_title(heading, fontsize=10)
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8,
               title=_title(hue) or None)
    return _save(fig, Path(out_dir), name, formats)


def plot_comparison(df: pd.DataFrame, by: str, metrics: list[str], out_dir: str | Path,
                    name: str, *, groups: Optional[list[str]] = None,
                    formats: tuple = ("png", "svg"), title: str = "") -> list[Path]:
    """Grouped bars: one bar per value of `by` (allocator, preemption mode) within each
    combination of `groups` (e.g. memory budget), one panel per metric."""
    groups = groups if groups is not None else [c for c in (BUDGET, BLOCK_SIZE)
                                                if c in df.columns and c != by]
    metrics = [m for m in metrics if m in df.columns]
    fig, axes = _figure(len(metrics), title or f"{by.rsplit('.', 1)[-1]} comparison")
    settings = list(dict.fromkeys(df[by]))
    labels = [label for label, _ in _groups(df, groups)]
    width = 0.8 / max(len(settings), 1)
    for ax, metric in zip(axes, metrics):
        for j, setting in enumerate(settings):
            heights = []
            for _, sub in _groups(df, groups):
                row = sub[sub[by] == setting]
                heights.append(float(pd.to_numeric(row[metric], errors="coerce").iloc[0])
                               if len(row) else float("nan"))
            xs = [i + (j - (len(settings) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, heights, width, label=str(setting), color=f"C{j}")
        ax.set_xticks(range(len(labels)), labels=labels, fontsize=8,
                      rotation=20 if len(labels) > 4 else 0)
        ax.set_xlabel(_title(groups), fontsize=8)
        ax.set_title(LABELS.get(metric, metric), fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        _log_if_wide(ax, df, metric)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8,
               title=_title([by]))
    return _save(fig, Path(out_dir), name, formats)


def plot_paged_vs_contiguous(df: pd.DataFrame, out_dir: str | Path, **kwargs) -> list[Path]:
    return plot_comparison(df, ALLOCATOR, PAGED_VS_CONTIGUOUS, out_dir, "paged_vs_contiguous",
                           title="paged vs contiguous KV at equal memory budget", **kwargs)


def plot_swap_vs_recompute(df: pd.DataFrame, out_dir: str | Path, **kwargs) -> list[Path]:
    return plot_comparison(df, PREEMPTION, SWAP_VS_RECOMPUTE, out_dir, "swap_vs_recompute",
                           title="preemption by swap vs recompute", **kwargs)


def plot_sweep(df: pd.DataFrame, grid_keys: list[str], out_dir: str | Path,
               formats: tuple = ("png", "svg")) -> list[Path]:
    """The plots that fit a sweep's grid: block-size study when the block size varies, the
    allocator and preemption-mode comparisons when those vary; otherwise the first grid key
    against the block-size study's metrics. Returns the written files."""
    if df.empty:
        return []
    paths: list[Path] = []
    if ALLOCATOR in grid_keys:
        paths += plot_paged_vs_contiguous(df, out_dir, formats=formats,
                                          groups=[k for k in grid_keys if k != ALLOCATOR])
    if PREEMPTION in grid_keys:
        paths += plot_swap_vs_recompute(df, out_dir, formats=formats,
                                        groups=[k for k in grid_keys if k != PREEMPTION])
    if BLOCK_SIZE in grid_keys:
        paths += plot_block_size_study(df, out_dir, formats=formats,
                                       hue=[k for k in grid_keys if k != BLOCK_SIZE])
    if not paths:
        x = grid_keys[0]
        numeric = pd.api.types.is_numeric_dtype(df[x])
        if numeric:
            paths += _plot_lines(df, x, [k for k in grid_keys if k != x], out_dir, formats)
        else:
            paths += plot_comparison(df, x, [m for ms in BLOCK_SIZE_PANELS for m in ms],
                                     out_dir, "sweep", formats=formats,
                                     groups=[k for k in grid_keys if k != x])
    return paths


def _plot_lines(df, x: str, hue: list[str], out_dir, formats) -> list[Path]:
    panels = [m for ms in BLOCK_SIZE_PANELS for m in ms if m in df.columns]
    fig, axes = _figure(len(panels), f"sweep over {x}")
    for ax, metric in zip(axes, panels):
        for i, (label, sub) in enumerate(_groups(df, hue)):
            sub = sub.sort_values(x)
            ax.plot(sub[x], pd.to_numeric(sub[metric], errors="coerce"), "-o", color=f"C{i}",
                    markersize=4, label=label)
        ax.set_xlabel(x)
        ax.set_title(LABELS.get(metric, metric), fontsize=10)
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8,
               title=_title(hue) or None)
    return _save(fig, Path(out_dir), "sweep", formats)
