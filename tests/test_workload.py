"""Synthetic workloads: seeded arrivals, lengths, shared prefixes, n, cancellations, tenants."""
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from simkv.workload.traces import COLUMNS, load_trace, trace_stats, write_canonical
from simkv.errors import InputError
from simkv.workload.synthetic import generate_synthetic


def spec(**changes) -> dict:
    base = {"num_requests": 200, "arrival": {"process": "poisson", "rate": 10},
            "prompt_tokens": {"dist": "fixed", "value": 100},
            "output_tokens": {"dist": "fixed", "value": 20}}
    return {**base, **changes}


def cv(values: np.ndarray) -> float:
    return float(values.std() / values.mean())


# --- determinism and shape -------------------------------------------------------------------

def test_frame_is_canonical_and_starts_at_zero():
    df = generate_synthetic(spec(), seed=0)
    assert list(df.columns) == COLUMNS and len(df) == 200
    assert df["arrival_s"].iloc[0] == 0.0 and df["arrival_s"].is_monotonic_increasing
    assert df["request_id"].tolist() == list(range(200))
    assert df["prefix_ids"].isna().all() and (df["n"] == 1).all()
    assert df["cancel_after_s"].isna().all() and (df["tenant"] == "").all()


FULL_SPEC = spec(prompt_tokens={"dist": "lognormal", "mean": 500, "sigma": 0.8},
                 shared_prefix={"num_groups": 3, "prefix_tokens": 64, "fraction": 0.5},
                 n={"dist": "uniform", "min": 1, "max": 4}, cancel_fraction=0.2, tenants=2)


def test_same_seed_gives_an_identical_frame():
    pd.testing.assert_frame_equal(generate_synthetic(FULL_SPEC, seed=7),
                                  generate_synthetic(FULL_SPEC, seed=7))


def test_different_seeds_give_different_frames():
    a, b = generate_synthetic(FULL_SPEC, seed=1), generate_synthetic(FULL_SPEC, seed=2)
    assert not np.array_equal(a["arrival_s"], b["arrival_s"])
    assert not np.array_equal(a["prompt_tokens"], b["prompt_tokens"])


def test_turning_on_a_feature_leaves_the_other_draws_unchanged():
    plain = generate_synthetic(spec(prompt_tokens={"dist": "uniform", "min": 1, "max": 999}), 3)
    more = generate_synthetic(spec(prompt_tokens={"dist": "uniform", "min": 1, "max": 999},
                                   cancel_fraction=0.5, tenants=4), 3)
    assert np.array_equal(plain["arrival_s"], more["arrival_s"])
    assert np.array_equal(plain["prompt_tokens"], more["prompt_tokens"])


def test_synthetic_frame_round_trips_through_the_canonical_csv(tmp_path):
    original = generate_synthetic(FULL_SPEC, seed=5)
    again = load_trace(write_canonical(original, tmp_path / "synthetic.csv"))
    pd.testing.assert_frame_equal(again, original)


# --- arrivals --------------------------------------------------------------------------------

def test_poisson_arrivals_have_the_rate_and_cv_1():
    df = generate_synthetic(spec(num_requests=20_000,
                                 arrival={"process": "poisson", "rate": 8}), 0)
    gaps = np.diff(df["arrival_s"])
    assert 1 / gaps.mean() == pytest.approx(8, rel=0.03)
    assert cv(gaps) == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("target_cv", [0.5, 2.0, 4.0])
def test_gamma_arrivals_have_the_rate_and_requested_cv(target_cv):
    df = generate_synthetic(spec(num_requests=50_000,
                                 arrival={"process": "gamma", "rate": 5, "cv": target_cv}), 0)
    gaps = np.diff(df["arrival_s"])
    assert 1 / gaps.mean() == pytest.approx(5, rel=0.05)
    assert cv(gaps) == pytest.approx(target_cv, rel=0.08)


def test_fixed_arrivals_are_evenly_spaced():
    df = generate_synthetic(spec(num_requests=5, arrival={"process": "fixed", "rate": 4}), 0)
    assert df["arrival_s"].tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_duration_s_bounds_the_arrivals_instead_of_a_count():
    workload = spec(duration_s=600, arrival={"process": "poisson", "rate": 20})
    del workload["num_requests"]
    df = generate_synthetic(workload, 0)
    assert df["arrival_s"].max() < 600
    assert len(df) == pytest.approx(12_000, rel=0.03)


# --- lengths ---------------------------------------------------------------------------------

def test_lognormal_mean_is_the_distribution_mean_not_the_median():
    df = generate_synthetic(spec(num_requests=50_000,
                                 prompt_tokens={"dist": "lognormal", "mean": 1000, "sigma": 1.0}),
                            0)
    prompt = df["prompt_tokens"]
    assert prompt.mean() == pytest.approx(1000, rel=0.03)
    assert prompt.median() == pytest.approx(1000 * math.exp(-0.5), rel=0.03)
    assert prompt.min() >= 1


def test_lognormal_lengths_are_clipped_to_min_and_max():
    df = generate_synthetic(spec(num_requests=5000, output_tokens={
        "dist": "lognormal", "mean": 200, "sigma": 1.5, "min": 10, "max": 400}), 0)
    assert df["output_tokens"].min() == 10 and df["output_tokens"].max() == 400


def test_uniform_lengths_cover_both_bounds_inclusively():
    df = generate_synthetic(spec(prompt_tokens={"dist": "uniform", "min": 5, "max": 7}), 0)
    assert set(df["prompt_tokens"]) == {5, 6, 7}


def test_a_bare_integer_is_a_fixed_length():
    df = generate_synthetic(spec(output_tokens=33), 0)
    assert (df["output_tokens"] == 33).all()


def test_empirical_lengths_resample_a_trace_relative_to_base_dir(tmp_path):
    (tmp_path / "lengths.csv").write_text("arrival_s,prompt_tokens,output_tokens\n"
                                          "0,10,1\n1,20,2\n2,30,3\n")
    df = generate_synthetic(spec(num_requests=300, prompt_tokens={
        "dist": "empirical", "trace": "lengths.csv"}, output_tokens={
        "dist": "empirical", "trace": "lengths.csv", "column": "prompt_tokens"}), 0,
        base_dir=tmp_path)
    assert set(df["prompt_tokens"]) == {10, 20, 30}
    assert set(df["output_tokens"]) == {10, 20, 30}


# --- shared prefixes -------------------------------------------------------------------------

SHARED = spec(num_requests=400, prompt_tokens={"dist": "uniform", "min": 1, "max": 100},
              shared_prefix={"num_groups": 4, "prefix_tokens": 40, "fraction": 0.25})


def test_shared_prefix_goes_to_the_exact_fraction_and_is_included_in_the_prompt():
    plain = generate_synthetic({**SHARED, "shared_prefix": None}, 0)
    df = generate_synthetic(SHARED, 0)
    has_ids = df["prefix_ids"].notna()
    assert has_ids.sum() == 100
    added = df["prompt_tokens"] - plain["prompt_tokens"]
    assert set(added[has_ids]) == {40} and set(added[~has_ids]) == {0}
    assert set(df["prefix_block_tokens"][has_ids]) == {16}
    assert set(df["prefix_block_tokens"][~has_ids]) == {0}


def test_prefix_ids_cover_every_block_and_only_full_prefix_blocks_are_shared():
    df = generate_synthetic(SHARED, 0).dropna(subset=["prefix_ids"])
    ids = df["prefix_ids"]
    assert (ids.map(len) == -(-df["prompt_tokens"] // 16)).all()
    # 40 prefix tokens at 16 per block: blocks 0 and 1 are all prefix; block 2 holds user tokens
    assert {i[:2] for i in ids} == {(0, 1), (2, 3), (4, 5), (6, 7)}
    assert all(i[2] >= 8 for i in ids)


def assert_chained_and_disjoint(ids: pd.Series) -> None:
    """Equal id at position j implies an equal prefix up to j; ids never move position."""
    prefix_of = {}
    for row in ids.dropna():
        for j, block_id in enumerate(row):
            assert prefix_of.setdefault(block_id, row[:j + 1]) == row[:j + 1]


def test_shared_prefix_ids_are_chained_and_unique_ids_never_collide():
    df = generate_synthetic(SHARED, 0)
    assert_chained_and_disjoint(df["prefix_ids"])
    flat = [i for row in df["prefix_ids"].dropna() for i in row[2:]]
    assert len(flat) == len(set(flat)) and min(flat) >= 8


def test_prefix_sharing_is_visible_in_trace_stats():
    stats = trace_stats(generate_synthetic({**SHARED, "num_requests": 2000}, 0))
    assert stats["prefix_fraction"] == 0.25 and stats["prefix_block_tokens"] == 16
    assert 0.2 < stats["prefix_repeat_fraction"] < 0.5


@settings(max_examples=40, deadline=None)
@given(groups=st.integers(1, 5), prefix=st.integers(1, 80), block=st.integers(1, 32),
       fraction=st.floats(0, 1), seed=st.integers(0, 2**32))
def test_prefix_ids_are_chained_for_any_prefix_and_block_size(groups, prefix, block, fraction,
                                                               seed):
    df = generate_synthetic(spec(num_requests=30, prompt_tokens={
        "dist": "uniform", "min": 1, "max": 60}, shared_prefix={
        "num_groups": groups, "prefix_tokens": prefix, "fraction": fraction,
        "block_tokens": block}), seed)
    assert_chained_and_disjoint(df["prefix_ids"])
    with_ids = df.dropna(subset=["prefix_ids"])
    assert (with_ids["prefix_ids"].map(len) == -(-with_ids["prompt_tokens"] // block)).all()


# --- n, cancellations, tenants ---------------------------------------------------------------

def test_n_takes_an_integer_or_a_distribution():
    assert (generate_synthetic(spec(n=3), 0)["n"] == 3).all()
    df = generate_synthetic(spec(n={"dist": "uniform", "min": 1, "max": 2}), 0)
    assert set(df["n"]) == {1, 2}


def test_cancel_fraction_cancels_that_many_requests_within_cancel_max_s():
    df = generate_synthetic(spec(cancel_fraction=0.3, cancel_max_s=2.0), 0)
    cancel = df["cancel_after_s"].dropna()
    assert len(cancel) == 60
    assert cancel.min() >= 0 and cancel.max() <= 2.0


def test_tenants_are_assigned_uniformly():
    df = generate_synthetic(spec(num_requests=3000, tenants=3), 0)
    counts = df["tenant"].value_counts()
    assert set(counts.index) == {"t0", "t1", "t2"}
    assert counts.min() > 900


# --- bad specs -------------------------------------------------------------------------------

BAD_SPECS = [
    (spec(colour="red"), "workload.synthetic.colour: unknown key"),
    ({**spec(), "duration_s": 10}, "exactly one of num_requests or duration_s"),
    (spec(num_requests=0), "workload.synthetic.num_requests: 0 is not in [1, 1,000,000]"),
    (spec(arrival={"process": "weibull", "rate": 1}), "workload.synthetic.arrival.process"),
    (spec(arrival={"process": "poisson", "rate": -1}), "workload.synthetic.arrival.rate"),
    (spec(arrival={"process": "gamma", "rate": 1}), "workload.synthetic.arrival.cv is required"),
    (spec(arrival={"process": "poisson", "rate": 1, "cv": 2}), "workload.synthetic.arrival.cv"),
    (spec(prompt_tokens={"dist": "zipf"}), "workload.synthetic.prompt_tokens.dist"),
    (spec(prompt_tokens={"dist": "uniform", "min": 9, "max": 3}),
     "workload.synthetic.prompt_tokens.max"),
    (spec(output_tokens={"dist": "lognormal", "mean": 0, "sigma": 1}),
     "workload.synthetic.output_tokens.mean"),
    (spec(output_tokens={"dist": "fixed", "value": "ten"}),
     "workload.synthetic.output_tokens.value"),
    (spec(output_tokens=None), "workload.synthetic.output_tokens is required"),
    (spec(prompt_tokens={"dist": "empirical", "trace": "missing.csv"}),
     "workload.synthetic.prompt_tokens.trace: file not found"),
    (spec(shared_prefix={"num_groups": 2, "prefix_tokens": 10, "fraction": 1.5}),
     "workload.synthetic.shared_prefix.fraction"),
    (spec(shared_prefix={"num_groups": 2, "fraction": 0.5}),
     "workload.synthetic.shared_prefix.prefix_tokens is required"),
    (spec(n=0), "workload.synthetic.n: 0 is not in [1, 1,024]"),
    (spec(n=True), "workload.synthetic.n: expected an integer"),
    (spec(cancel_fraction=-0.1), "workload.synthetic.cancel_fraction"),
    (spec(tenants=0.5), "workload.synthetic.tenants"),
]


@pytest.mark.parametrize("bad,fragment", BAD_SPECS, ids=[b[1][:40] for b in BAD_SPECS])
def test_bad_spec_raises_input_error_naming_the_key(tmp_path, bad, fragment):
    with pytest.raises(InputError) as error:
        generate_synthetic(bad, 0, base_dir=tmp_path)
    assert fragment in str(error.value)


def test_seed_must_be_a_non_negative_integer():
    with pytest.raises(InputError, match="seed"):
        generate_synthetic(spec(), -1)
