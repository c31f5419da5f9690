"""The longest pause between two steps of a vLLM real-time run while requests run, the requests
it holds up, and the TTFT mean without them, measured and simulated (CPU).

    simkv run SCENARIO_ASYNC.yaml --set cost_model=.../step-profile/fit.json --out SIM
    python scripts/vllm_device/stalls.py SIM/requests.csv RUN_DIR [RUN_DIR ...]

SCENARIO_ASYNC: the validation scenario as vLLM ran it (`scheduler.async_scheduling: true`,
`semantics: vllm-0.26`, the default). A request is held up when it arrived before the pause ended
and had no first token before it began.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd


def longest_pause(steps: pd.DataFrame) -> tuple:
    """(start_s, seconds) of the longest gap from a step's start to the next one's, among steps
    that run requests."""
    gaps = steps["start_s"].shift(-1) - steps["start_s"]
    gaps = gaps[steps["num_running"] > 0]
    i = gaps.idxmax()
    return float(steps.loc[i, "start_s"]), float(gaps[i])


def main(argv: list) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    simulated = pd.read_csv(argv[0]).set_index("request_id")
    means = []
    for run in argv[1:]:
        run = Path(run)
        steps = pd.read_csv(run / "realtime" / "steps.csv")
        measured = pd.read_csv(run / "realtime" / "requests.csv").set_index("request_id")
        start, seconds = longest_pause(steps)
        held = measured[(measured["arrival_s"] <= start + seconds)
                        & (measured["first_token_s"] >= start)].index
        m_all, s_all = measured["ttft_s"].mean(), simulated["ttft_s"].mean()
        m_rest = measured.drop(held)["ttft_s"].mean()
        s_rest = simulated.drop(held)["ttft_s"].mean()
        means.append((m_all, s_all, m_rest, s_rest))
        print(f"{run}: pause of {seconds * 1000:.0f} ms at {start:.3f} s holds up {len(held)} "
              f"requests; TTFT mean measured {m_all * 1000:.1f} ms, simulated "
              f"{s_all * 1000:.1f} ms; without them {m_rest * 1000:.1f} and {s_rest * 1000:.1f} ms")
    m_all, s_all, m_rest, s_rest = (sum(x) / len(means) for x in zip(*means))
    print(f"error of the mean over the runs: {100 * (s_all / m_all - 1):+.1f}% with every "
          f"request, {100 * (s_rest / m_rest - 1):+.1f}% without those held up")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
