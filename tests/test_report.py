"""The capacity report's pieces: the knee of a load curve, differences judged against noise and
the sentences that say so, and figures with SLO lines, axes from 0 and the legend outside."""
import pandas as pd
import pytest

from simkv.whatif import report


# ----------------------------------------------------------------------------------------------
# The knee


def test_the_knee_of_a_hockey_stick_is_the_last_point_before_latency_climbs():
    # scaled: x 0, .25, .5, .75, 1; y 0, .005, .016, .051, 1 -> gaps .245, .484, .699: index 3
    assert report.knee_index([1, 2, 3, 4, 5], [0.05, 0.06, 0.08, 0.15, 2.0]) == 3


def test_a_straight_or_concave_curve_has_no_knee():
    assert report.knee_index([1, 2, 3, 4], [1, 2, 3, 4]) is None
    assert report.knee_index([1, 2, 3, 4], [0, 3, 3.5, 4]) is None


def test_a_bend_smaller_than_the_minimum_gap_is_no_knee():
    # scaled gaps 0.5 - 0.45 = 0.05 at the middle point: below the default 0.1
    assert report.knee_index([0, 1, 2], [0, 0.45, 1]) is None
    assert report.knee_index([0, 1, 2], [0, 0.45, 1], min_gap=0.01) == 1


def test_the_knee_is_found_in_unsorted_points_and_indexes_the_input():
    assert report.knee_index([5, 1, 4, 2, 3], [2.0, 0.05, 0.15, 0.06, 0.08]) == 2


def test_fewer_than_three_points_have_no_knee():
    assert report.knee_index([1, 2], [1, 5]) is None


# ----------------------------------------------------------------------------------------------
# Differences and their noise


def test_a_paired_difference_whose_interval_holds_zero_is_within_noise():
    # differences 1, 2, 3 (mean 2, sd 1): 2 ± t(0.975, 2) / sqrt(3), t = 4.30265 (tables: 4.303)
    d = report.difference([11, 13, 15], [10, 11, 12])
    assert d.mean == pytest.approx(2.0)
    half = 4.302653 / 3 ** 0.5
    assert (d.low, d.high) == pytest.approx((2 - half, 2 + half), rel=1e-6)
    assert d.within_noise


def test_a_constant_paired_difference_is_outside_noise():
    d = report.difference([20, 21, 22], [10, 11, 12])
    assert (d.low, d.high) == pytest.approx((10.0, 10.0))
    assert not d.within_noise


def test_a_difference_within_the_search_resolution_is_no_difference():
    # 100 against 104 with a 5% bracket: |-4| <= 0.05 x 104 = 5.2
    assert report.difference([100], [104], resolution=0.05).within_noise
    assert not report.difference([100], [104], resolution=0.03).within_noise


def test_welch_difference_of_equal_samples_is_within_noise():
    assert report.difference([1, 2, 3], [1, 2, 3, 2], paired=False).within_noise


def test_a_paired_difference_needs_as_many_replicates_on_both_sides():
    with pytest.raises(ValueError):
        report.difference([1, 2], [1, 2, 3])


def test_the_sentence_says_no_difference_when_within_noise():
    text = report.compare_sentence("swap", [0.1266], "recompute", [0.1271], what="TTFT p90",
                                   unit="s", resolution=0.05)
    assert "no difference within noise" in text
    assert "lower" not in text and "higher" not in text


def test_the_sentence_names_the_higher_one_and_by_how_much_when_outside_noise():
    text = report.compare_sentence("a", [20, 21, 22], "b", [10, 11, 12], what="capacity",
                                   unit="requests/s")
    assert "a is higher than b by 10 requests/s (91%)" in text
    assert "95% interval +10 to +10 over 3 replicates" in text


def test_one_replicate_says_its_noise_is_not_measured():
    text = report.compare_sentence("a", [20], "b", [10], what="capacity", unit="requests/s")
    assert "one replicate" in text


def test_no_winner_is_crowned_among_ties():
    values = {"a": [10, 11, 12], "b": [10.1, 11.0, 12.2], "c": [5, 5.5, 6]}
    assert report.leaders(values) == ["b", "a"]
    text = report.ranking_sentence(values, what="Capacity", unit="requests/s")
    assert "b and a share the highest figure" in text and "no difference within noise" in text
    assert "has the highest" not in text


def test_a_clear_best_is_named_with_the_evidence_against_the_next():
    values = {"a": [20, 21, 22], "b": [10, 11, 12], "c": [5, 5.5, 6]}
    text = report.ranking_sentence(values, what="Capacity", unit="requests/s")
    assert text.startswith("Capacity: a has the highest figure")
    assert "a is higher than b by 10 requests/s" in text


def test_all_tied_says_so():
    values = {"a": [10, 11, 12], "b": [10.1, 11.0, 12.2]}
    assert "no difference within noise between any" in report.ranking_sentence(
        values, what="Capacity", unit="requests/s")


def test_lower_is_better_ranks_the_smallest_first():
    assert report.leaders({"a": [3.0], "b": [1.0]}, higher_is_better=False) == ["b"]


def test_thousands_are_written_out():
    text = report.compare_sentence("a", [4679.0], "b", [2356.0], what="tokens/s", unit="tokens/s")
    assert "a 4,679, b 2,356 tokens/s" in text and "e+03" not in text


# ----------------------------------------------------------------------------------------------
# Figures


def load_frame(ttft=(0.05, 0.06, 0.08, 0.15, 2.0)):
    rates = [4, 8, 12, 16, 20]
    return pd.DataFrame({
        "configuration": ["a"] * 5 + ["b"] * 5, "rate_rps": rates * 2,
        "ttft_s.p90": list(ttft) + [0.05] * 5, "tpot_s.p90": [0.010, 0.011, 0.012, 0.013, 0.014] * 2,
        "slo_attainment": [1, 1, 1, 0.95, 0.3] + [1] * 5})


def test_load_curves_draw_every_slo_the_attainment_target_and_the_knee():
    fig, knees = report.plot_load_curves(load_frame(), slo={"ttft_s": 0.5, "tpot_s": 0.05},
                                         attainment=0.9)
    slo = report.figure_lines(fig, "slo")
    assert sorted(line.get_ydata()[0] for line in slo) == [0.05, 0.5, 0.9]
    assert knees == {"a": 16.0, "b": None}
    (knee,) = report.figure_lines(fig, "knee")
    assert list(knee.get_xdata()) == [16.0]


def test_a_percentile_slo_is_drawn_on_its_panel():
    fig, _ = report.plot_load_curves(load_frame(), slo={"ttft_p90_s": 2.0}, attainment=0.9)
    ttft_axis = fig.axes[0]
    assert [line.get_ydata()[0] for line in ttft_axis.lines if line.get_gid() == "slo"] == [2.0]


def test_latency_axes_start_at_zero_so_one_percent_looks_flat():
    frame = load_frame(ttft=(0.100, 0.1002, 0.1004, 0.1006, 0.101))
    fig, _ = report.plot_load_curves(frame, slo={"ttft_s": 0.5}, attainment=0.9)
    bottom, top = fig.axes[0].get_ylim()
    assert bottom == 0 and top > 0.5       # the SLO line is on the axis too
    assert fig.axes[0].get_yscale() == "linear"


def test_a_latency_spanning_more_than_twenty_times_goes_log():
    fig, _ = report.plot_load_curves(load_frame(ttft=(0.05, 0.06, 0.08, 0.15, 20.0)),
                                     slo={"ttft_s": 0.5}, attainment=0.9)
    assert fig.axes[0].get_yscale() == "log"


def test_the_legend_is_the_figures_outside_the_axes_never_over_a_title():
    fig, _ = report.plot_load_curves(load_frame(), slo={"ttft_s": 0.5}, attainment=0.9)
    assert all(ax.get_legend() is None for ax in fig.axes)
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels.count("a") == 1 and "SLO ttft_s ≤ 0.5 s" in labels
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()                         # lays the figure out as saving does
    renderer = canvas.get_renderer()
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent(renderer))
        assert not box.overlaps(ax.title.get_window_extent(renderer))
    assert not box.overlaps(fig._suptitle.get_window_extent(renderer))


def requests_frame(ttft, tpot):
    return pd.DataFrame({"ttft_s": ttft, "tpot_s": tpot, "status": "completed"})


def test_cdfs_draw_the_slo_bounds_and_start_at_zero():
    fig = report.plot_cdfs({"a": requests_frame([0.1, 0.2, 0.3], [0.01, 0.02, 0.03])},
                           slo={"ttft_s": 0.5, "tpot_s": 0.05})
    assert sorted(line.get_xdata()[0] for line in report.figure_lines(fig, "slo")) == [0.05, 0.5]
    assert all(ax.get_xlim()[0] == 0 for ax in fig.axes)
    assert all(ax.get_xlim()[1] >= 0.75 * b for ax, b in zip(fig.axes, (0.5, 0.05)))


def test_cdfs_go_log_when_one_configuration_is_overloaded():
    fig = report.plot_cdfs({"a": requests_frame([0.1, 0.2, 0.3], [0.01] * 3),
                            "b": requests_frame([10.0, 20.0, 30.0], [0.01] * 3)},
                           slo={"ttft_s": 0.5})
    assert fig.axes[0].get_xscale() == "log" and fig.axes[1].get_xscale() == "linear"


def test_cdfs_leave_out_requests_that_did_not_complete():
    df = pd.DataFrame({"ttft_s": [0.1, None], "tpot_s": [0.01, None],
                       "status": ["completed", "rejected"]})
    fig = report.plot_cdfs({"a": df}, slo={})
    (line,) = [ln for ln in fig.axes[0].lines if ln.get_gid() != "slo"]
    assert list(line.get_ydata()) == [1.0]


def test_capacity_plot_draws_replicates_intervals_and_an_axis_from_zero():
    table = pd.DataFrame({"configuration": ["a", "b"], "replicates": [[20, 22, 24], [10, 11, 12]],
                          "ci_low": [17.0, 8.5], "ci_high": [27.0, 13.5],
                          "planning_rps": [20, 10]})
    fig = report.plot_capacity(table)
    (ax,) = fig.axes
    assert ax.get_xlim()[0] == 0 and ax.get_xlim()[1] >= 24
    assert len(report.figure_lines(fig, "interval")) == 2


def test_time_series_show_the_kv_fraction_waiting_and_running():
    steps = pd.DataFrame({"start_s": [0.0, 1.0, 2.0], "kv_blocks_used": [0, 50, 100],
                          "kv_blocks_free": [100, 50, 0], "num_waiting": [0, 3, 1],
                          "num_running": [1, 2, 4]})
    fig = report.plot_time_series({"a": steps})
    kv, waiting, running = (ax.lines[0].get_ydata() for ax in fig.axes)
    assert list(kv) == [0.0, 0.5, 1.0] and list(waiting) == [0, 3, 1]
    assert fig.axes[0].get_ylim() == (0, 1.02)
    assert all(ax.get_ylim()[0] == 0 for ax in fig.axes)


def test_describe_figures_counts_what_each_draws():
    fig, _ = report.plot_load_curves(load_frame(), slo={"ttft_s": 0.5}, attainment=0.9)
    assert report.describe_figures({"load": fig}) == {
        "load": {"slo_lines": 2, "knees": 1, "axes_legends": 0, "figure_legends": 1}}
