"""Trace loading: the canonical frame from Azure, Mooncake, BurstGPT and canonical CSV files."""
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from simkv.workload.traces import (COLUMNS, detect_format, load_trace, trace_stats,
                               write_canonical)
from simkv.errors import InputError

SHARED = Path(__file__).parent.parent.parent / "shared" / "traces"
AZURE = SHARED / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = SHARED / "mooncake-fast25" / "synthetic_trace.jsonl"
needs_azure = pytest.mark.skipif(not AZURE.is_file(), reason=f"shared trace missing: {AZURE}")
needs_mooncake = pytest.mark.skipif(not MOONCAKE.is_file(),
                                    reason=f"shared trace missing: {MOONCAKE}")

# CRLF and no final newline, as the published Azure files; one empty output, one empty prompt.
AZURE_TEXT = ("TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
              "2023-11-16 18:15:46.6805900,374,44\r\n"
              "2023-11-16 18:15:50.9951690,396,109\r\n"
              "2023-11-16 18:15:51.2224970,879,0\r\n"
              "2023-11-16 18:15:52.0000000,0,5\r\n"
              "2023-11-16 18:15:53.5000000,100,7")
MOONCAKE_TEXT = ('{"timestamp": 0, "input_length": 600, "output_length": 20, "hash_ids": [0, 1]}\n'
                 '{"timestamp": 1500, "input_length": 1024, "output_length": 5, '
                 '"hash_ids": [0, 2]}\n'
                 '{"timestamp": 2000, "input_length": 10, "output_length": 1, "hash_ids": [7]}\n')
BURSTGPT_TEXT = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,472,18,490,Conversation log\n"
                 "45,ChatGPT,1087,0,1087,Conversation log\n"
                 "118,GPT-4,417,276,693,Conversation log\n")
CANONICAL_TEXT = ("arrival_s,prompt_tokens,output_tokens,prefix_ids,prefix_block_tokens,tenant,"
                  "adapter,n,cancel_after_s\n"
                  "0.0,40,8,1 2 3,16,acme,,1,\n"
                  "0.25,20,4,1 5,16,acme,lora-a,2,1.5\n"
                  "1.5,7,3,,,,,,\n")


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode())
    return path


@pytest.fixture
def hand_written(tmp_path):
    return {"azure": write(tmp_path, "azure.csv", AZURE_TEXT),
            "mooncake": write(tmp_path, "mooncake.jsonl", MOONCAKE_TEXT),
            "burstgpt": write(tmp_path, "burst.csv", BURSTGPT_TEXT),
            "csv": write(tmp_path, "canonical.csv", CANONICAL_TEXT)}


# --- the shared real traces ------------------------------------------------------------------

@needs_azure
def test_shared_azure_trace_loads_19366_requests_over_3502_s():
    df = load_trace(AZURE)        # its loading time: benchmarks/trace_load.py
    assert len(df) == 19366
    assert df["arrival_s"].iloc[-1] == pytest.approx(3501.72, abs=0.01)
    assert df.attrs["format"] == "azure" and df.attrs["dropped"] == {}


@needs_azure
def test_shared_azure_trace_stats_match_its_readme():
    stats = trace_stats(load_trace(AZURE))
    assert stats["rate_rps"] == pytest.approx(5.5, abs=0.1)
    assert stats["interarrival_cv"] == pytest.approx(1.1, abs=0.05)
    prompt, output = stats["prompt_tokens"], stats["output_tokens"]
    assert (prompt["p50"], prompt["p99"], prompt["max"]) == (1020, 4142, 14050)
    assert (output["p50"], output["p90"], output["p99"], output["max"]) == (129, 424, 601, 1000)
    assert stats["prefix_fraction"] == 0.0 and stats["prefix_repeat_fraction"] is None


@needs_mooncake
def test_shared_mooncake_trace_loads_3993_requests_with_512_token_prefix_ids():
    df = load_trace(MOONCAKE)     # its loading time: benchmarks/trace_load.py
    assert len(df) == 3993 and df.attrs["format"] == "mooncake"
    assert df["arrival_s"].iloc[-1] == pytest.approx(1022.025)
    assert (df["prefix_block_tokens"] == 512).all()
    assert (df["prefix_ids"].map(len) == -(-df["prompt_tokens"] // 512)).all()


@needs_mooncake
def test_shared_mooncake_trace_repeats_about_64_percent_of_prompt_blocks():
    stats = trace_stats(load_trace(MOONCAKE))
    assert stats["prefix_fraction"] == 1.0 and stats["prefix_block_tokens"] == 512
    assert stats["prefix_repeat_fraction"] == pytest.approx(0.64, abs=0.01)
    assert stats["prompt_tokens"]["p50"] == 11587 and stats["prompt_tokens"]["max"] == 191378


@pytest.mark.parametrize("path", [pytest.param(AZURE, marks=needs_azure),
                                  pytest.param(MOONCAKE, marks=needs_mooncake)])
def test_shared_trace_round_trips_through_the_canonical_csv(path, tmp_path):
    original = load_trace(path)
    again = load_trace(write_canonical(original, tmp_path / "trace.csv"))
    pd.testing.assert_frame_equal(again, original)


# --- each format, hand-written ---------------------------------------------------------------

def test_frame_has_the_canonical_columns_in_order(hand_written):
    for path in hand_written.values():
        df = load_trace(path)
        assert list(df.columns) == COLUMNS
        assert df["request_id"].tolist() == list(range(len(df)))
        assert df["arrival_s"].iloc[0] == 0.0


def test_azure_reads_crlf_without_final_newline_and_drops_empty_rows(hand_written):
    df = load_trace(hand_written["azure"])
    assert df["prompt_tokens"].tolist() == [374, 396, 100]
    assert df["output_tokens"].tolist() == [44, 109, 7]
    assert df["arrival_s"].tolist() == pytest.approx([0.0, 4.314579, 6.81941])
    assert df.attrs["dropped"] == {"empty output (GeneratedTokens == 0)": 1,
                                   "empty prompt (ContextTokens == 0)": 1}


def test_azure_2024_timestamps_with_a_utc_offset_load(tmp_path):
    path = write(tmp_path, "code_1week.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2024-05-10 00:00:00.0093480+00:00,4808,10\n"
                 "2024-05-10 00:00:02.0093480+00:00,3180,8\n")
    assert load_trace(path)["arrival_s"].tolist() == [0.0, 2.0]


def test_mooncake_hash_ids_become_prefix_ids_at_512_tokens_per_block(hand_written):
    df = load_trace(hand_written["mooncake"])
    assert df["prefix_ids"].tolist() == [(0, 1), (0, 2), (7,)]
    assert df["prefix_block_tokens"].tolist() == [512, 512, 512]
    assert df["arrival_s"].tolist() == [0.0, 1.5, 2.0]  # milliseconds -> seconds


def test_burstgpt_drops_failed_requests_and_counts_them(hand_written):
    df = load_trace(hand_written["burstgpt"])
    assert df["prompt_tokens"].tolist() == [472, 417]
    assert df["arrival_s"].tolist() == [0.0, 113.0]
    assert df.attrs["dropped"] == {"failed (Response tokens == 0)": 1}


def test_canonical_csv_reads_every_optional_column(hand_written):
    df = load_trace(hand_written["csv"])
    assert df["prefix_ids"].tolist() == [(1, 2, 3), (1, 5), None]
    assert df["prefix_block_tokens"].tolist() == [16, 16, 0]
    assert df["tenant"].tolist() == ["acme", "acme", ""]
    assert df["adapter"].tolist() == ["", "lora-a", ""]
    assert df["n"].tolist() == [1, 2, 1]
    assert math.isnan(df["cancel_after_s"][0]) and df["cancel_after_s"][1] == 1.5


def test_canonical_csv_ignores_unknown_columns_with_a_warning(tmp_path):
    path = write(tmp_path, "extra.csv",
                 "arrival_s,prompt_tokens,output_tokens,colour\n0,5,5,red\n")
    df = load_trace(path)
    assert "colour" not in df.columns
    assert any("colour" in w for w in df.attrs["warnings"])


def test_unsorted_arrivals_are_sorted_stably_with_a_warning(tmp_path):
    path = write(tmp_path, "unsorted.csv", "arrival_s,prompt_tokens,output_tokens\n"
                 "2.0,1,1\n1.0,2,1\n3.0,3,1\n1.0,4,1\n")
    df = load_trace(path)
    assert df["prompt_tokens"].tolist() == [2, 4, 1, 3]
    assert df["arrival_s"].tolist() == [0.0, 0.0, 1.0, 2.0]
    assert df.attrs["warnings"] == ["2 request(s) arrived out of order; sorted by arrival"]


def test_time_scale_multiplies_inter_arrival_times(hand_written):
    df = load_trace(hand_written["mooncake"], time_scale=2.0)
    assert df["arrival_s"].tolist() == [0.0, 3.0, 4.0]


def test_limit_keeps_the_first_requests_after_sorting(tmp_path):
    path = write(tmp_path, "t.csv", "arrival_s,prompt_tokens,output_tokens\n5,1,1\n3,2,1\n4,3,1\n")
    df = load_trace(path, limit=2)
    assert df["prompt_tokens"].tolist() == [2, 3] and df["arrival_s"].tolist() == [0.0, 1.0]


@pytest.mark.parametrize("name,text,expected", [
    ("a.csv", AZURE_TEXT, "azure"),
    ("a.txt", AZURE_TEXT, "azure"),
    ("m.jsonl", MOONCAKE_TEXT, "mooncake"),
    ("m.log", MOONCAKE_TEXT, "mooncake"),
    ("b.csv", BURSTGPT_TEXT, "burstgpt"),
    ("c.csv", CANONICAL_TEXT, "csv"),
])
def test_detect_format_by_extension_and_header(tmp_path, name, text, expected):
    assert detect_format(write(tmp_path, name, text)) == expected


@pytest.mark.parametrize("fmt", ["azure", "mooncake", "burstgpt", "csv"])
def test_every_format_round_trips_through_the_canonical_csv(hand_written, tmp_path, fmt):
    original = load_trace(hand_written[fmt], time_scale=0.5)
    again = load_trace(write_canonical(original, tmp_path / "out.csv"))
    pd.testing.assert_frame_equal(again, original)
    assert again.attrs["format"] == "csv"


def test_write_canonical_replaces_the_file_atomically_leaving_no_temp_file(hand_written,
                                                                          tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    target = out / "trace.csv"
    target.write_text("old contents")
    write_canonical(load_trace(hand_written["csv"]), target)
    assert [p.name for p in out.iterdir()] == ["trace.csv"]
    lines = target.read_text().splitlines()
    assert lines[0] == ("arrival_s,prompt_tokens,output_tokens,prefix_ids,prefix_block_tokens,"
                        "tenant,adapter,n,cancel_after_s")
    assert lines[1] == "0.0,40,8,1 2 3,16,acme,,1,"


def test_trace_stats_counts_blocks_that_repeat_an_earlier_prefix(hand_written):
    stats = trace_stats(load_trace(hand_written["mooncake"]))
    assert stats["prefix_repeat_fraction"] == pytest.approx(1 / 5)  # block 0 of request 1
    assert stats["requests"] == 3 and stats["duration_s"] == 2.0
    assert stats["rate_rps"] == 1.5
    json.dumps(stats, allow_nan=False)


def test_trace_stats_reports_n_cancel_tenants_and_drops(hand_written):
    stats = trace_stats(load_trace(hand_written["csv"]))
    assert stats["n_gt1_fraction"] == pytest.approx(1 / 3)
    assert stats["cancel_fraction"] == pytest.approx(1 / 3)
    assert stats["tenants"] == 1
    assert trace_stats(load_trace(hand_written["burstgpt"]))["dropped"] == {
        "failed (Response tokens == 0)": 1}


# --- bad input: InputError naming the file and the line or column -----------------------------

AZ_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
CSV_HEADER = "arrival_s,prompt_tokens,output_tokens\n"
BAD_INPUTS = [
    ("empty.csv", "", "auto", ["empty file"]),
    ("header_only.csv", AZ_HEADER, "azure", ["no requests"]),
    ("no_gen.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6,3\n", "azure",
     ["GeneratedTokens", "TIMESTAMP, ContextTokens, GeneratedTokens"]),
    ("bad_time.csv", AZ_HEADER + "2023-11-16 18:15:46.6,3,4\nyesterday,3,4\n", "azure",
     ["line 3", "TIMESTAMP"]),
    ("bad_tokens.csv", AZ_HEADER + "2023-11-16 18:15:46.6,3,4\n2023-11-16 18:15:47.6,abc,4\n",
     "azure", ["line 3", "ContextTokens", "'abc'"]),
    ("negative.csv", AZ_HEADER + "2023-11-16 18:15:46.6,3,-4\n", "azure",
     ["line 2", "GeneratedTokens", ">= 0"]),
    ("fields.csv", AZ_HEADER + "2023-11-16 18:15:46.6,3,4,9\n", "azure", ["line 2", "fields"]),
    ("truncated.jsonl", MOONCAKE_TEXT + '{"timestamp": 3000, "input_len', "mooncake",
     ["line 4", "invalid JSON"]),
    ("wrong_hashes.jsonl", '{"timestamp": 0, "input_length": 1025, "output_length": 1, '
     '"hash_ids": [1, 2]}\n', "mooncake", ["line 1", "hash_ids has 2", "= 3"]),
    ("no_input.jsonl", '{"timestamp": 0, "output_length": 1, "hash_ids": []}\n', "mooncake",
     ["line 1", "input_length"]),
    ("float_len.jsonl", '\n{"timestamp": 0, "input_length": 1.5, "output_length": 1, '
     '"hash_ids": [1]}\n', "mooncake", ["line 2", "input_length", "integer"]),
    ("ids.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}\n',
     "mooncake", ["line 1", "hash_ids"]),
    ("burst_cols.csv", "Timestamp,Model,Request tokens\n5,ChatGPT,472\n", "burstgpt",
     ["Response tokens"]),
    ("burst_time.csv", BURSTGPT_TEXT + "soon,ChatGPT,4,4,8,Conversation log\n", "burstgpt",
     ["line 5", "Timestamp"]),
    ("no_prompt.csv", "arrival_s,output_tokens\n0,1\n", "csv", ["prompt_tokens"]),
    ("zero_prompt.csv", CSV_HEADER + "0,1,1\n1,0,1\n", "csv", ["line 3", "prompt_tokens", ">= 1"]),
    ("half_token.csv", CSV_HEADER + "0,1.5,1\n", "csv", ["line 2", "prompt_tokens", "integer"]),
    ("ids_count.csv", "arrival_s,prompt_tokens,output_tokens,prefix_ids,prefix_block_tokens\n"
     "0,40,1,1 2,16\n", "csv", ["line 2", "prefix_ids has 2", "= 3"]),
    ("ids_text.csv", "arrival_s,prompt_tokens,output_tokens,prefix_ids,prefix_block_tokens\n"
     "0,4,1,7,16\n0,4,1,x,16\n", "csv", ["line 3", "prefix_ids", "integers"]),
    ("ids_no_block.csv", "arrival_s,prompt_tokens,output_tokens,prefix_ids\n0,4,1,7\n", "csv",
     ["line 2", "prefix_block_tokens"]),
    ("cancel.csv", "arrival_s,prompt_tokens,output_tokens,cancel_after_s\n0,4,1,-1\n", "csv",
     ["line 2", "cancel_after_s"]),
    ("n.csv", "arrival_s,prompt_tokens,output_tokens,n\n0,4,1,0\n", "csv", ["line 2", "n must"]),
    ("mystery.csv", "when,what\n1,2\n", "auto", ["line 1", "cannot tell the trace format"]),
]


@pytest.mark.parametrize("name,text,fmt,fragments", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_input_error_naming_file_and_place(tmp_path, name, text, fmt,
                                                            fragments):
    path = write(tmp_path, name, text)
    with pytest.raises(InputError) as error:
        load_trace(path, format=fmt)
    message = str(error.value)
    assert name in message and "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_unknown_format_name_lists_the_valid_ones(hand_written):
    with pytest.raises(InputError, match="unknown trace format 'parquet'.*azure, mooncake"):
        load_trace(hand_written["csv"], format="parquet")


def test_missing_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="nope.csv: trace file not found"):
        load_trace(tmp_path / "nope.csv")


@pytest.mark.parametrize("kwargs", [{"time_scale": 0}, {"time_scale": -1.0}, {"limit": 0},
                                    {"limit": 1.5}])
def test_bad_time_scale_or_limit_is_an_input_error(hand_written, kwargs):
    with pytest.raises(InputError, match=f"canonical.csv: {next(iter(kwargs))} must be"):
        load_trace(hand_written["csv"], **kwargs)
