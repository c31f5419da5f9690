"""What-if sweeps: one scenario simulated at every point of a grid of dotted keys.

    out/
      sweep.json          the scenario, fixed overrides and grid (--resume checks the first two)
      sweep.csv           one row per finished point, in grid order; rewritten atomically
      points/<id>.json    {"point", "summary", "slo"}: the record --resume reads

Points run in parallel on a process pool (`local`) or a dask.distributed cluster (`dask`); the
parent process alone writes files, as each point finishes: first its point file, then the whole
`sweep.csv` again (temp file + rename). A sweep killed at any moment (kill -9) leaves only
complete files behind, and `--resume` skips every point that has a point file. Both backends give
identical files: rows are in grid order and every column is deterministic except `wall_time_s`.

Columns of sweep.csv: the grid keys, every scalar of the summary (families flattened as
`ttft_s.p90`), then, when the scenario sets SLOs, `slo_met` and `slo_attainment` judged by the
rule of `simkv.whatif.capacity.judge_slo` (the one `simkv capacity` uses).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import pandas as pd

from simkv.config.scenario import load_scenario, parse_set
from simkv.engine.results import atomic_write_csv, atomic_write_text
from simkv.errors import InputError
from simkv.limits import check_number
from simkv.workload.frames import load_requests_frame

BACKENDS = ("local", "dask")
NONDETERMINISTIC_COLUMNS = ["wall_time_s"]   # the only column that differs between reruns


# ----------------------------------------------------------------------------------------------
# The grid


def parse_grid(items: Iterable[str]) -> dict[str, list]:
    """`--grid KEY=V1,V2,...` items -> {dotted key: [typed values]} in the order given.

    Values are typed as the key's field (as `--set` does). Raises InputError for a malformed
    item, an unknown key, a bad value or a key given twice.
    """
    grid: dict[str, list] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or not text.strip():
            raise InputError(f"--grid {item!r}: expected KEY=V1,V2,... "
                             "(e.g. cache.block_size=8,16,32)")
        if key in grid:
            raise InputError(f"--grid {key}: given twice; put all its values in one --grid")
        values = []
        for value in text.split(","):
            try:
                values.append(parse_set([f"{key}={value.strip()}"])[key])
            except InputError as e:
                raise InputError(str(e).replace("--set", "--grid", 1)) from None
        if len(set(map(_canonical, values))) < len(values):
            raise InputError(f"--grid {key}: a value is repeated in {text!r}")
        grid[key] = values
    if not grid:
        raise InputError("sweep needs at least one --grid KEY=V1,V2,...")
    return grid


def grid_points(grid: dict[str, list]) -> list[dict[str, Any]]:
    """Every point of the grid ({key: value}), the last key varying fastest."""
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*grid.values())]


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def point_id(point: dict[str, Any]) -> str:
    """A stable file name for a point: readable key=value parts plus a short hash of the values."""
    digest = hashlib.sha1(_canonical(point).encode()).hexdigest()[:10]
    readable = "_".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items())
    readable = re.sub(r"[^A-Za-z0-9=._-]+", "-", readable)[:80]
    return f"{readable}__{digest}"


# ----------------------------------------------------------------------------------------------
# One point (runs in a worker process; everything it takes and returns is plain data)


def run_point(raw: dict, base_dir: str, source: str, point: dict[str, Any]) -> dict:
    """Simulate the scenario dict `raw` with `point`'s overrides.

    Returns {"summary": summary dict, "slo": {"met", "attainment"} or None without SLOs}.
    """
    from simkv.sim.engine import simulate
    from simkv.whatif.capacity import judge_slo

    scenario = load_scenario(raw, point, base_dir=Path(base_dir), source=source)
    result = simulate(scenario)
    slo = None
    if scenario.slo:
        verdict = judge_slo(result.summary, result.requests, scenario.slo)
        slo = {"met": verdict.met, "attainment": verdict.attainment}
    return {"summary": result.summary, "slo": slo}


def flatten_summary(summary: dict) -> dict[str, Any]:
    """Scalars as they are, families ({mean,p50,p90,p99}) as `ttft_s.p90` etc.; the
    provenance stays in the point's JSON (it is not a figure)."""
    flat: dict[str, Any] = {}
    for key, value in summary.items():
        if key in ("provenance", "warnings"):  # not measures (warnings: lines about the input)
            continue
        if isinstance(value, dict):
            flat.update({f"{key}.{stat}": v for stat, v in value.items()})
        else:
            flat[key] = value
    return flat


def sweep_frame(grid: dict[str, list], finished: dict[str, dict]) -> pd.DataFrame:
    """One row per finished point of `grid` (grid order): grid keys, the summary's scalars,
    then `slo_met` and `slo_attainment` when judged.

    `finished` maps a point's canonical key to its outcome (as `run_point` returns it). A
    summary key equal to a grid key (e.g. `cost_model`) keeps the grid's value.
    """
    rows = []
    for point in grid_points(grid):
        outcome = finished.get(_canonical(point))
        if outcome is None:
            continue
        row = {k: v for k, v in flatten_summary(outcome["summary"]).items() if k not in point}
        if outcome.get("slo") is not None:
            row.update(slo_met=outcome["slo"]["met"], slo_attainment=outcome["slo"]["attainment"])
        rows.append({**row, **point})
    columns = list(grid)
    for row in rows:  # union of summary keys, in order of first appearance
        columns.extend(k for k in row if k not in columns)
    return pd.DataFrame(rows, columns=columns)


# ----------------------------------------------------------------------------------------------
# The output folder


class SweepStore:
    """The files of one sweep under `out_dir`; only the parent process writes them."""

    def __init__(self, out_dir: str | Path):
        self.out_dir = Path(out_dir)
        self.points_dir = self.out_dir / "points"
        self.csv_path = self.out_dir / "sweep.csv"
        self.manifest_path = self.out_dir / "sweep.json"

    def exists(self) -> bool:
        return self.manifest_path.exists() or self.csv_path.exists() or (
            self.points_dir.is_dir() and any(self.points_dir.glob("*.json")))

    def start(self, manifest: dict, resume: bool) -> None:
        """Check a resumed sweep is the same experiment, remove stale temp files, write the
        manifest. Raises InputError when `out_dir` holds another sweep."""
        if self.exists() and not resume:
            raise InputError(f"{self.out_dir}: holds an earlier sweep; pass --resume to finish it "
                             "or choose another --out")
        if resume and self.manifest_path.exists():
            try:
                old = json.loads(self.manifest_path.read_text())
            except (OSError, ValueError):
                old = None
            if old is not None and _canonical(old.get("scenario")) != _canonical(
                    manifest["scenario"]):
                raise InputError(
                    f"{self.out_dir}: --resume of a sweep of another scenario or other --set "
                    f"values (was {old.get('source')} with {old.get('sets')}); choose another "
                    "--out")
        for tmp in [*self.out_dir.glob(".sweep.*"), *self.points_dir.glob(".*")]:
            tmp.unlink(missing_ok=True)  # temp files of a run killed mid-write
        self.points_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.manifest_path, json.dumps(manifest, indent=2) + "\n")

    def finished(self) -> dict[str, dict]:
        """{canonical point: {"summary", "slo"}} of every point file."""
        done = {}
        for path in sorted(self.points_dir.glob("*.json")):
            try:
                record = json.loads(path.read_text())
                done[_canonical(record["point"])] = {"summary": record["summary"],
                                                     "slo": record.get("slo")}
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not ours or unreadable: that point simply runs again
        return done

    def record(self, point: dict, outcome: dict) -> None:
        record = {"point": point, **outcome}
        atomic_write_text(self.points_dir / f"{point_id(point)}.json",
                          json.dumps(record, indent=2) + "\n")

    def write_csv(self, grid: dict[str, list], finished: dict[str, dict]) -> pd.DataFrame:
        df = sweep_frame(grid, finished)
        atomic_write_csv(self.csv_path, df)
        return df


# ----------------------------------------------------------------------------------------------
# Running a sweep


def run_sweep(scenario_path: str | Path, grid: dict[str, list], out_dir: str | Path, *,
              sets: Optional[dict[str, Any]] = None, backend: str = "local",
              dask_address: Optional[str] = None, workers: Optional[int] = None,
              resume: bool = False, progress: bool = False,
              on_error: Optional[Callable[[dict, BaseException], None]] = None) -> pd.DataFrame:
    """Simulate `scenario_path` (with `sets`) at every point of `grid`; returns the sweep frame.

    Every point is validated before anything runs (InputError names the point). Finished points
    are written as they arrive; with `resume`, points already in `out_dir` are skipped. A point
    whose simulation raises is reported to `on_error` (default: re-raised at the end) and left
    out of `sweep.csv`, so that a later --resume runs it again.
    """
    if backend not in BACKENDS:
        raise InputError(f"--backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    if workers is not None:
        check_number(workers, "--workers", "--workers")
    scenario_path = Path(scenario_path)
    sets = dict(sets or {})
    base = load_scenario(scenario_path, sets)
    workloads = set()
    for point in grid_points(grid):  # bad points fail now, not an hour in
        try:
            scenario = load_scenario(base.raw, point, base_dir=scenario_path.resolve().parent,
                                     source=str(scenario_path))
            scenario.path = scenario_path
            # the workload too (a bad trace row, a generator's bad key), once per distinct one
            wl = scenario.workload
            workload = json.dumps([str(wl.trace), wl.format, wl.time_scale, wl.limit,
                                   wl.synthetic, scenario.seed], sort_keys=True, default=str)
            if workload not in workloads:
                workloads.add(workload)
                load_requests_frame(scenario)
        except InputError as e:
            raise InputError(f"grid point {_describe(point)}: {e}") from None

    store = SweepStore(out_dir)
    store.start({"source": str(scenario_path), "sets": sets, "scenario": base.raw,
                 "grid": grid}, resume)
    finished = store.finished() if resume else {}
    todo = [p for p in grid_points(grid) if _canonical(p) not in finished]
    frame = store.write_csv(grid, finished)
    failures: list = []
    args = (base.raw, str(scenario_path.resolve().parent), str(scenario_path))
    total = len(grid_points(grid))
    with _progress(progress, total, total - len(todo), base.name) as advance:
        def on_done(point: dict, outcome: Optional[dict], error: Optional[BaseException]):
            nonlocal frame
            if error is None:
                store.record(point, outcome)
                finished[_canonical(point)] = outcome
                frame = store.write_csv(grid, finished)
            else:
                failures.append((point, error))
                if on_error is not None:
                    on_error(point, error)
            advance()

        if todo:
            runner = _run_local if backend == "local" else _run_dask
            runner(args, todo, on_done, workers=workers, address=dask_address)
    if failures and on_error is None:
        point, error = failures[0]
        raise RuntimeError(f"{len(failures)} grid point(s) failed; first {_describe(point)}: "
                           f"{error}") from error
    return frame


def _describe(point: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items())


def _run_local(args: tuple, todo: list[dict], on_done, *, workers: Optional[int],
               address: Optional[str]) -> None:
    """A process pool; forkserver (not fork) so that threads of the parent are never copied."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    workers = min(workers or os.cpu_count() or 1, len(todo))
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method)) as pool:
        futures = {pool.submit(run_point, *args, point): point for point in todo}
        for future in as_completed(futures):
            error = future.exception()
            on_done(futures[future], None if error else future.result(), error)


def _run_dask(args: tuple, todo: list[dict], on_done, *, workers: Optional[int],
              address: Optional[str]) -> None:
    """A dask.distributed Client at `address`, or a LocalCluster of `workers` processes."""
    import logging

    try:
        from dask.distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise InputError("--backend dask needs dask.distributed: pip install 'dask[distributed]'") \
            from None
    if address:
        try:
            client = Client(address, timeout="10s")
        except (OSError, TimeoutError) as e:
            raise InputError(f"--dask-address {address}: cannot connect ({e})") from None
        cluster = None
    else:
        cluster = LocalCluster(n_workers=min(workers or os.cpu_count() or 1, len(todo)),
                               threads_per_worker=1, processes=True, dashboard_address=None,
                               silence_logs=logging.ERROR)
        client = Client(cluster)
    try:
        futures = {client.submit(run_point, *args, point, pure=False): i
                   for i, point in enumerate(todo)}
        for future in as_completed(futures):
            point = todo[futures[future]]
            error = future.exception() if future.status == "error" else None
            on_done(point, None if error else future.result(), error)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


class _progress:
    """A rich progress bar over grid points on stderr (or nothing); yields `advance()`."""

    def __init__(self, enabled: bool, total: int, already: int, label: str):
        self.enabled, self.total, self.already, self.label = enabled, total, already, label

    def __enter__(self):
        if not self.enabled:
            return lambda: None
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self.bar = Progress(TextColumn("[bold]sweep {task.description}"), BarColumn(),
                            MofNCompleteColumn(), TextColumn("points"), TimeElapsedColumn(),
                            TimeRemainingColumn(), console=Console(stderr=True))
        self.bar.__enter__()
        task = self.bar.add_task(self.label, total=self.total, completed=self.already)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc) if self.enabled else False
