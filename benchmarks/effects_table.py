"""What each cost-model effect changes on the validation scenarios: served-step error and TPOT
error against the engine's measured runs, with every effect, each one left out, and none.

    python benchmarks/effects_table.py [--measured profiles/h200/llama-3.1-8b/validation]

Prints a markdown table (docs/profiling.md keeps the committed one). The measured runs are the
committed lease's; the profile is the bundled one. Needs the shared traces (../shared/traces).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
EFFECTS = ("clock", "shared_reads", "engine_host")
VARIANTS = {"all": list(EFFECTS), "no clock": ["shared_reads", "engine_host"],
            "no shared_reads": ["clock", "engine_host"], "no engine_host": ["clock", "shared_reads"],
            "none": []}


def one(args) -> tuple:
    """(scenario, variant, served-step error, TPOT mean error) of one comparison."""
    import simkv
    from simkv.validation.compare import compare_validation
    from simkv.validation.diagnostics import served_step_error
    yaml_path, measured, variant = args
    scn = simkv.load_scenario(yaml_path, overrides={"cost_model.effects": VARIANTS[variant]})
    with tempfile.TemporaryDirectory() as tmp:
        result = compare_validation(measured, scn, Path(tmp) / "result.json", plots=False)
    return yaml_path.stem, variant, served_step_error(result), result["error"]["tpot_s.mean"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", type=Path,
                    default=ROOT / "profiles/h200/llama-3.1-8b/validation")
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args(argv)
    jobs = [(y, a.measured / y.stem, v) for y in sorted((ROOT / "scenarios/validation").glob(
        "*.yaml")) if (a.measured / y.stem).is_dir() for v in VARIANTS]
    with ProcessPoolExecutor(a.workers) as pool:
        rows = list(pool.map(one, jobs))
    table = {(s, v): (e, t) for s, v, e, t in rows}
    names = sorted({s for s, _, _, _ in rows})
    head = " | ".join(f"{v}" for v in VARIANTS)
    print(f"| scenario | {head} |")
    print("|---|" + "---|" * len(VARIANTS))
    for s in names:
        cells = " | ".join(f"{table[s, v][0]:.2%} / {table[s, v][1]:+.1%}" for v in VARIANTS)
        print(f"| {s} | {cells} |")
    means = " | ".join(
        f"{sum(table[s, v][0] for s in names) / len(names):.2%} / "
        f"{sum(abs(table[s, v][1]) for s in names) / len(names):.1%}" for v in VARIANTS)
    print(f"| mean (TPOT: of the magnitudes) | {means} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
