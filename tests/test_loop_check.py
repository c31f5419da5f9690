"""The serving loop written once: the GPU engine measured after the change makes the committed
earlier measurement's decisions in every step of a saturated run (docs/validation.md, "The one
serving loop on the GPU")."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

PROFILE = Path(__file__).resolve().parent.parent / "profiles/h200/llama-3.1-8b"
DECISIONS = ["step", "num_prefill_tokens", "num_decode_tokens", "num_running", "num_waiting",
             "kv_blocks_used", "kv_blocks_free", "preempted"]


def test_the_one_loop_on_the_gpu_makes_the_earlier_engines_saturated_decisions():
    name = "azure-conv-load60-bs16/saturated/steps.csv"
    after, before = PROFILE / "loop-check" / name, PROFILE / "validation" / name
    if not (after.is_file() and before.is_file()):
        pytest.skip("the loop-check measurement is not in this checkout")
    after, before = pd.read_csv(after), pd.read_csv(before)
    assert len(after) == len(before) > 800
    pd.testing.assert_frame_equal(after[DECISIONS], before[DECISIONS])
