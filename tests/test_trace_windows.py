"""Trace windows (offset and length), BurstGPT's model filter, length scales, and resampling:
the workload knobs that make a trace's noise visible (docs/traces.md)."""
import numpy as np
import pandas as pd
import pytest

import simkv
from simkv.errors import InputError
from simkv.whatif.capacity import replicate_frame
from simkv.workload.frames import load_requests_frame
from simkv.workload.traces import load_trace
from tests.test_cli_commands import simkv as simkv_cli
from tests.test_traces import AZURE_TEXT, BURSTGPT_TEXT, CANONICAL_TEXT, write


def trace_scenario(tmp_path, text, name="trace.csv", **workload):
    trace = write(tmp_path, name, text)
    return {"name": "window", "model": "llama-3.1-8b", "seed": 0,
            "workload": {"trace": str(trace), **workload}, "slo": {"ttft_s": 1.0}}


def test_an_offset_and_a_limit_cut_a_window_that_starts_at_zero(tmp_path):
    # the hand-written Azure file keeps 374, 396 and 100 prompt tokens (two rows are empty)
    df = load_trace(write(tmp_path, "azure.csv", AZURE_TEXT), offset=1, limit=2)
    assert df["prompt_tokens"].tolist() == [396, 100] and df["request_id"].tolist() == [0, 1]
    assert df["arrival_s"].tolist() == pytest.approx([0.0, 53.5 - 50.995169])


def test_an_offset_past_the_last_request_is_bad_input(tmp_path):
    with pytest.raises(InputError, match="offset 3 skips every request .the trace has 3"):
        load_trace(write(tmp_path, "azure.csv", AZURE_TEXT), offset=3)


def test_burstgpt_rows_can_be_kept_by_model(tmp_path):
    df = load_trace(write(tmp_path, "burst.csv", BURSTGPT_TEXT), model_filter=["GPT-4"])
    assert df["prompt_tokens"].tolist() == [417] and df["arrival_s"].tolist() == [0.0]
    assert df.attrs["dropped"] == {"failed (Response tokens == 0)": 1, "Model not in GPT-4": 1}


def test_a_model_filter_needs_a_burstgpt_trace_and_a_model_it_has(tmp_path):
    with pytest.raises(InputError, match="needs a BurstGPT trace"):
        load_trace(write(tmp_path, "azure.csv", AZURE_TEXT), model_filter=["GPT-4"])
    with pytest.raises(InputError, match="the trace has: ChatGPT, GPT-4"):
        load_trace(write(tmp_path, "burst.csv", BURSTGPT_TEXT), model_filter=["Claude"])


def test_length_scales_multiply_round_and_keep_at_least_one_token(tmp_path):
    raw = trace_scenario(tmp_path, AZURE_TEXT, prompt_scale=0.5, output_scale=0.01)
    df = load_requests_frame(simkv.load_scenario(raw))
    assert df["prompt_tokens"].tolist() == [187, 198, 50]
    assert df["output_tokens"].tolist() == [1, 1, 1]        # 0.44, 1.09, 0.07 -> at least 1


def test_scaling_prompts_that_carry_prefix_ids_is_bad_input(tmp_path):
    raw = trace_scenario(tmp_path, CANONICAL_TEXT, prompt_scale=2.0)
    with pytest.raises(InputError, match="prompt_scale would break the prompts' prefix_ids"):
        load_requests_frame(simkv.load_scenario(raw))


def test_the_seed_changes_a_trace_replay_only_when_it_is_resampled(tmp_path):
    text = "arrival_s,prompt_tokens,output_tokens\n" + "".join(
        f"{i * 0.5},{10 + i},{1 + i % 7}\n" for i in range(64))
    def frame(seed, **workload):
        raw = {**trace_scenario(tmp_path, text, **workload), "seed": seed}
        return load_requests_frame(simkv.load_scenario(raw))
    pd.testing.assert_frame_equal(frame(0), frame(1))                       # a plain replay
    a, b, again = (frame(s, resample="bootstrap") for s in (0, 1, 0))
    pd.testing.assert_frame_equal(a, again)
    assert a["prompt_tokens"].tolist() != b["prompt_tokens"].tolist()
    assert len(a) == 64 and a["arrival_s"].is_monotonic_increasing


def test_window_replicates_are_the_next_windows_of_the_trace(tmp_path):
    text = "arrival_s,prompt_tokens,output_tokens\n" + "".join(
        f"{i * 0.5},{10 + i},4\n" for i in range(30))
    scn = simkv.load_scenario(trace_scenario(tmp_path, text, offset=2, limit=10))
    overrides, second = replicate_frame(scn, 1, "windows")
    assert overrides == {"workload.offset": 12}
    assert second["prompt_tokens"].tolist() == list(range(22, 32))
    assert second["arrival_s"].iloc[0] == 0.0
    with pytest.raises(InputError, match="window 3 .requests from 22. holds only 8 of 10"):
        replicate_frame(scn, 2, "windows")


def test_run_takes_the_window_as_options(tmp_path):
    text = "arrival_s,prompt_tokens,output_tokens\n" + "".join(
        f"{i * 0.5},{10 + i},4\n" for i in range(30))
    trace = write(tmp_path, "t.csv", text)
    done = simkv_cli("run", "scenarios/quickstart.yaml", "--trace", trace, "--offset", "5",
                     "--limit", "7", "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    requests = pd.read_csv(tmp_path / "out" / "requests.csv")
    assert requests["prompt_tokens"].tolist() == list(range(15, 22))
