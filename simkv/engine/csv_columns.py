"""Numeric columns as CSV text, a column at a time (numpy), for the long result files.

Each column becomes a matrix of ASCII bytes, one row per value, padded with NUL bytes anywhere
in the row; the columns and their separators are laid side by side and the NULs dropped, which
leaves the CSV's rows. The texts are those of the per-value writer (simkv.engine.results):
integers as `str` gives them, floats as `"{:.9g}".format` does, NaN empty.

Floats: a value v in [1e-4, 1e9) prints in fixed notation from its 9 significant digits,
correctly rounded: the integer nearest v x 10^(8 - e) (10^e <= v < 10^(e + 1)). That product,
in doubles, is one rounding of the exact one (10^k is exact), so below 1e9 it is within 6e-8 of
it, and where it lies more than 1e-6 from a half (and from the decade's ends) its nearest
integer is the exact product's. The other values (near a half, outside the range, 0, -0, inf)
are formatted by Python itself (tests/test_csv_columns.py compares both, those cases too).
"""
from __future__ import annotations

import numpy as np

_FLOAT = "{:.9g}".format
_POW10 = np.array([10.0 ** k for k in range(13)])    # exact
_NEAR = 1e-6          # a product this close to a rounding boundary goes to Python
_WIDTH = 15           # sign, "0.000", nine digits


_FOUR = (np.arange(10_000)[:, None] // np.array([1000, 100, 10, 1]) % 10 + 48) \
    .astype(np.uint8).view(np.uint32).ravel()    # four ASCII digits of 0..9999, as one word


def _digits(values: np.ndarray, width: int) -> np.ndarray:
    """The decimal digits of integers >= 0 as ASCII codes, right-aligned in `width` columns,
    leading zeros (but the last column's) as NUL."""
    groups = -(-width // 4)
    words = np.empty((len(values), groups), dtype=np.uint32)
    rest = values
    for g in range(groups - 1, -1, -1):          # four digits at a time, from the right
        rest, four = np.divmod(rest, 10_000)
        words[:, g] = _FOUR[four]
    out = words.view(np.uint8)[:, 4 * groups - width:]
    lead = np.cumprod(out[:, :-1] == 48, axis=1, dtype=bool)   # zeros with only zeros before
    out[:, :-1][lead] = 0
    return out


def int_fields(values: np.ndarray) -> np.ndarray:
    """`str` of each integer, as a NUL-padded byte matrix (one row per value)."""
    v = values.astype(np.int64, copy=False)
    if not len(v):
        return np.zeros((0, 1), dtype=np.uint8)
    low, high = int(v.min()), int(v.max())
    if low < 0:
        digits = _digits(np.abs(v), len(str(max(-low, high))))
        sign = np.where(v < 0, ord("-"), 0).astype(np.uint8)[:, None]
        return np.concatenate([sign, digits], axis=1)
    width = len(str(high))
    if high >= len(v) or width > 8:
        return _digits(v, width)
    # fewer distinct values than rows: the texts of 0..high, each row one lookup
    table = np.zeros((high + 1, 8), dtype=np.uint8)
    table[:, 8 - width:] = _digits(np.arange(high + 1), width)
    return table.view(np.uint64).ravel()[v][:, None].view(np.uint8)[:, 8 - width:]


def text_fields(texts: list) -> np.ndarray:
    """ASCII texts as a NUL-padded byte matrix."""
    if not texts:
        return np.zeros((0, 1), dtype=np.uint8)
    a = np.array(texts, dtype=bytes)
    return a.view(np.uint8).reshape(len(texts), a.dtype.itemsize)


def float_fields(values: np.ndarray) -> np.ndarray:
    """`"{:.9g}".format` of each float, NaN empty, as a NUL-padded byte matrix (module doc)."""
    x = values.astype(np.float64, copy=False)
    n = len(x)
    if not n:
        return np.zeros((0, 1), dtype=np.uint8)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return _float_fields(x, n)


def _float_fields(x: np.ndarray, n: int) -> np.ndarray:
    magnitude = np.abs(x)
    fixed = (magnitude >= 1e-4) & (magnitude < 1e9)          # NaN, inf, 0: False
    exponent = np.zeros(n, dtype=np.int64)
    exponent[fixed] = np.floor(np.log10(magnitude[fixed]))
    exponent = np.clip(exponent, -4, 8)
    scaled = magnitude * _POW10[8 - exponent]
    # log10 may miss the decade by one near its ends: move to the decade the product shows
    low, high = scaled < 1e8, scaled >= 1e9
    if low.any() or high.any():
        exponent = np.clip(exponent - low + high, -4, 8)
        scaled = magnitude * _POW10[8 - exponent]
    whole = np.floor(scaled)
    fraction = scaled - whole                   # exact
    fixed &= (np.abs(fraction - 0.5) > _NEAR) & (scaled >= 1e8 + _NEAR) \
        & (scaled < 1e9 - 0.5 - _NEAR)
    mantissa = np.where(fixed, whole + (fraction > 0.5), 1e8).astype(np.int64)
    out = _fixed_texts(mantissa, exponent, x < 0, fixed)
    python = np.flatnonzero(~fixed & ~np.isnan(x))
    if len(python):
        texts = text_fields([_FLOAT(v) for v in x[python].tolist()])
        if texts.shape[1] > out.shape[1]:
            out = np.concatenate(
                [out, np.zeros((n, texts.shape[1] - out.shape[1]), dtype=np.uint8)], axis=1)
        out[python, :texts.shape[1]] = texts
        out[python, texts.shape[1]:] = 0
    return out


def _fixed_texts(mantissa: np.ndarray, exponent: np.ndarray, negative: np.ndarray,
                 rows: np.ndarray) -> np.ndarray:
    """Fixed notation of m x 10^(e - 8) (m: nine digits, -4 <= e <= 8) as %g writes it, for
    the `rows` (a mask) of the values (the others all NUL): trailing zeros of the fraction
    dropped, and the point with them when none is left."""
    n = len(mantissa)
    out = np.zeros((n, _WIDTH), dtype=np.uint8)
    out[:, 0] = np.where(negative & rows, ord("-"), 0)
    digits = _digits(mantissa, 9)                      # m >= 1e8: no padding
    last = 8 - np.argmax(digits[:, ::-1] != 48, axis=1)      # the last nonzero digit
    digits[np.arange(9)[None, :] > np.maximum(last, exponent)[:, None]] = 0   # the fraction's
    for e in np.unique(exponent[rows]).tolist():       # one layout per decade
        at = np.flatnonzero(rows & (exponent == e))
        d = digits[at]
        if e >= 0:        # digits 0..e, the point (where a fraction digit is left), the rest
            point = np.where(last[at] > e, ord("."), 0).astype(np.uint8)[:, None]
            text = np.concatenate([d[:, :e + 1], point, d[:, e + 1:]], axis=1)
        else:             # "0.", -e - 1 zeros, the digits
            lead = np.full((len(at), 1 - e), ord("0"), dtype=np.uint8)
            lead[:, 1] = ord(".")
            text = np.concatenate([lead, d], axis=1)
        out[at, 1:1 + text.shape[1]] = text
    return out


def csv_rows(fields: list) -> str:
    """The CSV rows (each ending in a newline) of equally long field matrices, side by side."""
    n = len(fields[0])
    width = sum(f.shape[1] for f in fields) + len(fields)
    rows = np.zeros((n, width), dtype=np.uint8)
    at = 0
    for f in fields:
        rows[:, at:at + f.shape[1]] = f
        at += f.shape[1]
        rows[:, at] = ord(",")
        at += 1
    rows[:, -1] = ord("\n")
    flat = rows.ravel()
    return flat[flat != 0].tobytes().decode("ascii")
