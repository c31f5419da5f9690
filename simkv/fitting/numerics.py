"""Small numerics of the fits: non-negative least squares, relative-error fits and summaries,
and the rounding the fit files use."""
from __future__ import annotations

import math

import numpy as np

SIG_DIGITS = 6


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None,
         start: np.ndarray | None = None) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson & Hanson's active-set method, on the normal
    equations: the subproblems are as small as the number of columns). `start`: a guess of the
    positive coefficients (a boolean mask), used when its unconstrained solution is positive.

    Kept rather than scipy.optimize.nnls: refitting the committed H200 8B profile with scipy's
    gives the same coefficients and form (fit.json's every coefficient equal at 6 digits) but
    moves 34 of form_selection's cross-validation errors by up to 2.5% of themselves (a median
    0.0238 -> 0.0232), so a switch would change committed results; it took 13 against 52 CPU s
    (one run each, loaded 2-core VM) and is worth making with a refit committed beside it."""
    n = a.shape[1]
    gram, atb = a.T @ a, a.T @ b
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = atb.copy()
    tol = 1e-10 * max(1.0, float(np.abs(atb).max(initial=0.0)))

    def solve(mask):
        z = np.zeros(n)
        sub, rhs = gram[np.ix_(mask, mask)], atb[mask]
        try:
            zp = np.linalg.solve(sub, rhs)
            r = sub @ zp - rhs
            if np.isfinite(zp).all() and r @ r <= 1e-16 * (rhs @ rhs):
                z[mask] = zp
                return z
        except np.linalg.LinAlgError:
            pass
        z[mask] = np.linalg.lstsq(sub, rhs, rcond=1e-12)[0]   # collinear columns
        return z

    if start is not None and start.any():
        z = solve(start)
        if (z[start] > 0).all():
            passive, x = start.copy(), z
            w = atb - gram @ x
    for _ in range(max_iter or 3 * n + 30):
        if passive.all() or (w[~passive] <= tol).all():
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = solve(passive)
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-300
            x[~passive] = 0.0
        w = atb - gram @ x
    return x


def solve_relative(x: np.ndarray, t: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
    """Non-negative coefficients minimising the sum of squared relative errors of x @ c vs t
    (`start`: the coefficients expected to be positive, a warm start)."""
    a = x / t[:, None]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    return nnls(a / scale, np.ones(len(t)), start=start) / scale


def round_sig(value: float, digits: int = SIG_DIGITS) -> float:
    """`value` rounded to `digits` significant digits (0 and non-finite values unchanged)."""
    if value == 0 or not math.isfinite(value):
        return float(value)
    return float(f"{value:.{digits}g}")


def rms(err) -> float:
    """Root mean square of relative errors, rounded as the fit reports it."""
    return round(float(np.sqrt(np.mean(np.asarray(err) ** 2))), 4)


def close_enough(value: float, best: float) -> bool:
    """The CV rule: a simpler choice wins when its RMS is within 5% (relative) of the best."""
    return value <= best * 1.05 + 1e-12


def rel_error_summary(pred, meas) -> dict:
    """{median, p95, max, count} of |pred - meas| / meas."""
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    if len(meas) == 0:
        return {"median": None, "p95": None, "max": None, "count": 0}
    err = np.abs(pred - meas) / meas
    return {"median": round(float(np.median(err)), 4),
            "p95": round(float(np.percentile(err, 95)), 4),
            "max": round(float(err.max()), 4), "count": int(len(err))}

