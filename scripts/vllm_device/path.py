"""The request's way into vLLM and back, outside its steps (CPU): the figures of the simulator's
request-path term (`scheduler.admission_delay_s`, `scheduler.output_delay_s`,
`scheduler.output_delay_per_running_s`; docs/semantics.md, "The request path").

    python scripts/vllm_device/path.py [RAW_MIX] [SENT_CSV ...]

RAW_MIX (default the step profile's raw-mix.json.gz): the mix phases, where each step record
has the engine core's output timestamp (`core_t_s`) and the time the client's stat logger got
it (`t_s`), and each injected prompt its submission time (`arrivals_s`):

- the output path, engine core to client: t_s - core_t_s of every step, least squares on the
  requests running in it (the client's output handler takes each running request's output
  before the step's stats);
- the way in past the client: for each injected prompt that arrives alone in a decode stream,
  its submission to the engine core's output of its prompt step, less what the simulator's
  clock gives for it under asynchronous scheduling (half a decode period in the step it
  arrives in, the step already scheduled, then the prompt's window; prompts.py --mix).

SENT_CSV (default compare/path/*-sent.csv: `request_id,sent_s` from a validation run's driver
records, beside that run's committed requests.csv and steps.csv):

- the client's way out: its send after the trace arrival (sent_s - arrival_s);
- the last step: its first token after the stat record of the step that made it
  (first_token_s - the latest steps.csv t_s before it).

None of these is a TTFT: the TTFT that the term is judged on never enters. Prints each piece
(median, and its spread over runs or phases) and the three values (the medians' sums).
"""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))

V = Path("profiles/h200/llama-3.1-8b/vllm-0.26")


def output_path(raw: dict) -> tuple[float, float, int]:
    """(intercept s, slope s per running request, steps) of t_s - core_t_s on num_running."""
    x, y = [], []
    for ph in raw["phases"]:
        if "arrivals_s" not in ph:
            continue
        for s in ph["steps"]:
            if s.get("core_t_s") is None or s["num_prefill_tokens"] + s["num_decode_tokens"] == 0:
                continue
            x.append(s["num_running"])
            y.append(s["t_s"] - s["core_t_s"])
    x, y = np.asarray(x, float), np.asarray(y, float)
    a = np.c_[np.ones_like(x), x]
    (c0, c1), *_ = np.linalg.lstsq(a, y, rcond=None)
    return float(c0), float(c1), len(x)


def admission_excess(raw: dict) -> np.ndarray:
    """Seconds, one per isolated injected prompt: submission to its prompt step's output, less
    1.5 decode periods and its window (the rows of prompts.py --mix)."""
    from prompts import isolated_injections
    return np.asarray([(t_out - a) - (1.5 * d + window)
                       for _, a, t_out, window, d in isolated_injections(raw)])


def client_pieces(sent_csv: Path) -> tuple[np.ndarray, np.ndarray]:
    """(sent_s - arrival_s, first token - the stat record before it), seconds, per request of
    the run whose driver records gave `sent_csv` (<name>-<run>-sent.csv)."""
    name, run = sent_csv.name[:-len("-sent.csv")].rsplit("-", 1)
    folder = V / name / run / "realtime"
    req = pd.read_csv(folder / "requests.csv").merge(pd.read_csv(sent_csv), on="request_id")
    t = np.sort(pd.read_csv(folder / "steps.csv")["t_s"].to_numpy())
    first = req["first_token_s"].to_numpy()
    first = first[np.isfinite(first)]
    k = np.searchsorted(t, first) - 1
    after_stat = first[k >= 0] - t[k[k >= 0]]
    return (req["sent_s"] - req["arrival_s"]).to_numpy(), after_stat


def main(argv: list) -> int:
    raw_path = Path(argv[0]) if argv and argv[0].endswith((".json", ".gz")) else \
        V / "step-profile" / "raw-mix.json.gz"
    sent = [Path(a) for a in argv if a.endswith("-sent.csv")] or \
        sorted((V / "compare" / "path").glob("*-sent.csv"))
    data = raw_path.read_bytes()
    raw = json.loads(gzip.decompress(data) if raw_path.suffix == ".gz" else data)
    c0, c1, n = output_path(raw)
    exc = admission_excess(raw)
    print(f"engine core output -> client stat record ({raw_path.name}, {n} steps): "
          f"{c0 * 1e3:.3f} ms + {c1 * 1e6:.1f} us per running request")
    print(f"submission -> schedulable, beyond the simulator's clock ({len(exc)} prompts): "
          f"median {np.median(exc) * 1e3:.2f} ms (quartiles {np.percentile(exc, 25) * 1e3:.2f}"
          f"-{np.percentile(exc, 75) * 1e3:.2f})")
    sends, afters = [], []
    print("| run | requests | sent - arrival ms (median, mean) | first token - stat record ms "
          "(median, mean) |")
    print("|---|---|---|---|")
    for path in sent:
        s, a = client_pieces(path)
        sends.append(s)
        afters.append(a)
        print(f"| {path.name[:-len('-sent.csv')]} | {len(s)} | {np.median(s) * 1e3:.2f}, "
              f"{s.mean() * 1e3:.2f} | {np.median(a) * 1e3:.2f}, {a.mean() * 1e3:.2f} |")
    s_med = float(np.median(np.concatenate(sends)))
    a_med = float(np.median(np.concatenate(afters)))
    admission = s_med + float(np.median(exc))
    output = c0 + a_med
    print(f"pooled medians: sent - arrival {s_med * 1e3:.2f} ms, first token - stat "
          f"{a_med * 1e3:.2f} ms")
    print(f"--set scheduler.admission_delay_s={admission:.5f} "
          f"--set scheduler.output_delay_s={output:.5f} "
          f"--set scheduler.output_delay_per_running_s={c1:.7f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
