"""Generated scenario files either run or fail with one error line (issue 29).

Hypothesis writes scenario YAML files whose keys take valid values, values at the low end of
their rule, or bad ones (not finite, negative, huge, text, true/false, a list), with the
occasional key given twice or a byte that is not UTF-8, on tiny workloads and pools. Each runs
in process through `simkv.cli.run_cli` and must exit 0 (a summary written, nothing leaked) or 2
with exactly one `error: ...` line on stderr; any other exit or any exception fails the example
(run_cli re-raises what is not bad input). CI runs SIMKV_BAD_INPUT_EXAMPLES (default 200);
docs/fuzzing.md has the long run (2,000).
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, event, given, settings, strategies as st

from simkv.cli import run_cli
from simkv.limits import rule_for

EXAMPLES = int(os.environ.get("SIMKV_BAD_INPUT_EXAMPLES", "200"))

BAD = st.sampled_from([math.nan, math.inf, -math.inf, -1, 0, -0.5, 10**20, 1e300, "abc", "",
                       True, False, [1], {"a": 1}, None])
# key -> strategy of its valid values, kept small so that every run is short
VALID = {
    "seed": st.integers(0, 2**63 - 1),
    "step_time_scale": st.floats(0.01, 5),
    "cache.block_size": st.sampled_from([1, 8, 16, 32, 64]),
    "cache.gpu_memory_utilization": st.floats(0.5, 1.0),
    "cache.memory_budget_gib": st.floats(20, 139),
    "cache.watermark": st.floats(0, 0.2),
    "cache.swap_space_gib": st.floats(0, 8),
    "cache.num_gpu_blocks_override": st.integers(1, 600),
    "cache.enable_prefix_caching": st.booleans(),
    "cache.preemption_mode": st.sampled_from(["recompute", "swap"]),
    "cache.allocator": st.sampled_from(["paged", "contiguous"]),
    "scheduler.max_num_seqs": st.integers(1, 16),
    "scheduler.max_num_batched_tokens": st.integers(1, 4096),
    "scheduler.max_model_len": st.integers(1, 4096),
    "scheduler.long_prefill_token_threshold": st.integers(0, 256),
    "scheduler.enable_chunked_prefill": st.booleans(),
    "workload.time_scale": st.floats(0.001, 1000),
    "workload.limit": st.integers(1, 5),
    "slo.ttft_s": st.floats(1e-6, 100),
    "slo.tpot_p90_s": st.floats(1e-6, 100),
    "workload.synthetic.num_requests": st.integers(1, 5),
    "workload.synthetic.arrival.rate": st.floats(0.01, 1000),
    "workload.synthetic.prompt_tokens.value": st.integers(1, 512),
    "workload.synthetic.output_tokens.value": st.integers(1, 64),
    "workload.synthetic.n": st.integers(1, 3),
    "workload.synthetic.cancel_fraction": st.floats(0, 1),
    "workload.synthetic.cancel_max_s": st.floats(0.001, 10),
    "workload.synthetic.tenants": st.integers(1, 3),
}


def low_end(key):
    rule = rule_for(key) or rule_for(key.rsplit(".", 1)[0])
    if rule is None or rule.low_open:
        return None
    return int(rule.low) if rule.kind is int else float(rule.low)


@st.composite
def scenarios(draw):
    scn = {"model": "llama-3.1-8b",
           "cache": {"num_gpu_blocks_override": 256},
           "scheduler": {"max_model_len": 1024},
           "workload": {"synthetic": {"num_requests": 3,
                                      "arrival": {"process": "poisson", "rate": 5},
                                      "prompt_tokens": {"dist": "fixed", "value": 32},
                                      "output_tokens": {"dist": "fixed", "value": 4}}}}
    keys = draw(st.lists(st.sampled_from(sorted(VALID)), min_size=1, max_size=6, unique=True))
    bad = False
    for key in keys:
        how = draw(st.sampled_from(["valid", "valid", "low end", "bad"]))
        value = draw(VALID[key]) if how == "valid" else low_end(key) if how == "low end" \
            else draw(BAD)
        if how == "low end" and value is None:
            value = draw(VALID[key])
        bad |= how == "bad"
        node, parts = scn, key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else node
        node[parts[-1]] = value
    text = yaml.safe_dump(scn, sort_keys=False)
    mutation = draw(st.sampled_from(["none"] * 8 + ["duplicate key", "not UTF-8",
                                                    "a list for a section"]))
    if mutation == "duplicate key":
        text += "cache: {block_size: 16}\n"
    elif mutation == "a list for a section":
        text += "slo: [1, 2]\n"
    data = text.encode()
    if mutation == "not UTF-8":
        data += b"name: \xff\n"
    event(f"mutation: {mutation}")
    event(f"a bad value: {bad}")
    return data


@settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 200,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_a_generated_scenario_runs_or_fails_with_one_error_line(data):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "s.yaml").write_bytes(data)
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = run_cli(["run", str(folder / "s.yaml"), "--out", str(folder / "out"),
                            "--json"])
        event(f"exit {code}")
        lines = err.getvalue().splitlines()
        assert code in (0, 2), err.getvalue()
        if code == 2:
            assert len(lines) == 1 and lines[0].startswith("error: "), err.getvalue()
        else:
            assert all(line.startswith("warning: ") for line in lines), err.getvalue()
            summary = json.loads((folder / "out" / "summary.json").read_text())
            assert summary["leaked_blocks"] == 0
