"""The column-at-a-time CSV writer gives the text of the value-by-value one."""
import numpy as np
import pandas as pd

from simkv.engine.csv_columns import float_fields, int_fields
from simkv.engine.results import csv_text, csv_text_by_value


def _texts(fields: np.ndarray) -> list:
    return [bytes(row[row != 0]).decode() for row in fields]


def _python(values) -> list:
    return ["" if v != v else "{:.9g}".format(v) for v in np.asarray(values).tolist()]


def test_floats_print_as_python_formats_them_with_nine_digits():
    rng = np.random.default_rng(7)
    values = np.concatenate([rng.uniform(0, 4000, 20000), rng.exponential(0.02, 20000),
                             10 ** rng.uniform(-9, 12, 20000), -10 ** rng.uniform(-6, 10, 5000),
                             np.round(rng.uniform(0, 1000, 5000), 3)])
    assert _texts(float_fields(values)) == _python(values)


def test_floats_at_the_edges_print_as_python_formats_them():
    edges = [0.0, -0.0, np.nan, np.inf, -np.inf, 5e-324, 1.7e308, 1e-4, 9.99999999e-5,
             9.999999995e-5, 1e9, 999999999.4, 999999999.5, 99999999.95, 1e8, 0.1, 0.5, 1.0,
             10.0, 100.0, 2.5e-4, 1460.0000042376103, 420.0, 12345678.25]
    assert _texts(float_fields(np.array(edges))) == _python(edges)


def test_a_tie_at_the_ninth_digit_rounds_half_to_even_as_python_does():
    # 1234567.125 and 1234567.375 are exact halves at nine digits
    ties = [1234567.125, 1234567.375, 123456.5625, 0.5 + 2 ** -30]
    assert _texts(float_fields(np.array(ties))) == _python(ties) \
        == ["1234567.12", "1234567.38", "123456.562", "0.500000001"]


def test_binary_fractions_whose_ninth_digit_is_exact_print_as_python_formats_them():
    rng = np.random.default_rng(3)
    values = rng.integers(0, 10 ** 9, 20000) / 2.0 ** rng.integers(0, 14, 20000)
    assert _texts(float_fields(values)) == _python(values)


def test_integers_print_as_str():
    rng = np.random.default_rng(5)
    for values in ([0, 1, 9, 10, 99, 100, 123456789, 2 ** 61], [-5, -120, 0, 7],
                   rng.integers(0, 300, 5000), rng.integers(-10 ** 12, 10 ** 12, 5000),
                   np.arange(1, 5000), [0, 0, 0]):
        values = np.asarray(values, dtype=np.int64)
        assert _texts(int_fields(values)) == [str(v) for v in values.tolist()]


def test_a_frame_writes_as_value_by_value():
    frame = pd.DataFrame({
        "step": np.arange(1, 7), "start_s": [0.0, 0.0123, 1e-5, 3503.25, np.nan, 2.5],
        "blocks": np.array([0, 54348, 3, -2, 10, 10]), "status": ["completed", "a,b", None,
                                                                  'say "x"', "cancelled", ""],
        "flag": [True, False, True, True, False, False]})
    assert csv_text(frame) == csv_text_by_value(frame)
    assert csv_text(frame).splitlines()[2] == '2,0.0123,54348,"a,b",False'


def test_text_that_is_not_ascii_writes_value_by_value():
    frame = pd.DataFrame({"name": ["é", "b"], "x": [1.5, 2.0]})
    assert csv_text(frame) == csv_text_by_value(frame) == "name,x\né,1.5\nb,2\n"


def test_an_empty_frame_is_its_header():
    assert csv_text(pd.DataFrame({"a": [], "b": []})) == "a,b\n"
