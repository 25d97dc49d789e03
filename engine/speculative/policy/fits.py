"""Fits the adaptive policy prices steps by: exponential moving averages, weighted lines and
least squares over the (batch, K) tables costs.py keeps, and the tokens-and-slots fit of ragged
verify passes. Pure arithmetic on floats: no torch, no timing."""

from __future__ import annotations

import math
from collections.abc import Sequence


def smoothed(old: float | None, new: float, smoothing: float) -> float:
    """Exponential moving average step: `new` alone when there is no `old` yet."""
    return new if old is None else (1 - smoothing) * old + smoothing * new


class LineEstimate:
    """y = a + b x (b >= 0) from exponentially weighted moments of the (x, y) observed: a pass's
    fixed cost stays out of its cost per token (a few-token catch-up must not price a long one)."""

    VARIED = 0.1  # `varied`: x's standard deviation at least this share of its mean

    def __init__(self, smoothing: float):
        self.smoothing = smoothing
        self._moments: tuple[float, ...] | None = None  # means of x, y, x^2, x y

    def observe(self, x: float, y: float) -> None:
        new = (x, y, x * x, x * y)
        self._moments = new if self._moments is None else tuple(
            smoothed(old, n, self.smoothing) for old, n in zip(self._moments, new))

    def snapshot(self) -> list[float] | None:
        return None if self._moments is None else list(self._moments)

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) of y = a + b x (None before any observation)."""
        if self._moments is None:
            return None
        mx, my = self._moments[:2]
        slope = _slope(*self._moments)
        slope = my / max(mx, 1e-12) if slope is None else slope
        return my - slope * mx, slope

    @property
    def varied(self) -> bool:
        """Whether x has varied enough for a slope: a spread of at least VARIED of its mean."""
        if self._moments is None:
            return False
        mx, _, mxx, _ = self._moments
        return mxx - mx * mx >= (self.VARIED * mx) ** 2

    def restore(self, data: list[float] | None) -> None:
        """ValueError unless `data` is None or four finite numbers (the means of x, y, x^2, x y)."""
        if data is not None and (len(data) != 4 or not all(math.isfinite(float(v)) for v in data)):
            raise ValueError(f"a line's moments are four finite numbers, got {data!r}")
        self._moments = None if data is None else tuple(float(v) for v in data)

    def __call__(self, x: float) -> float:
        if self._moments is None:
            return 0.0
        mx, my = self._moments[:2]
        slope = _slope(*self._moments)
        return max(0.0, my + (my / max(mx, 1e-12) if slope is None else slope) * (x - mx))


def interpolated(values: list[float], x: float) -> float:
    """values (at 0, 1, ...) linearly interpolated at x in [0, len - 1]."""
    i = min(int(x), len(values) - 2)
    return values[i] + (values[i + 1] - values[i]) * (x - i)


def _slope(mx: float, my: float, mxx: float, mxy: float) -> float | None:
    """The least-squares slope (at least 0) from the means of x, y, x^2 and x y; None if x never varied."""
    spread = mxx - mx * mx
    return max(0.0, (mxy - mx * my) / spread) if spread > 1e-9 * max(mxx, 1e-12) else None


class PassCostFit:
    """seconds = a + b tokens + c slots of verify passes, by least squares over exponentially
    weighted moments: `tokens` the linears computed (a packed pass: the rows' total), `slots` the
    padded layout that attention, RoPE and the K/V writes run over (rows x the widest row). A
    padded pass has tokens = slots, so until ragged passes have told the two apart there is no fit."""

    def __init__(self, smoothing: float):
        self.smoothing = smoothing
        self._moments: list[float] | None = None  # means of x_i x_j (i <= j) and x_i y, x = (1, tokens, slots)

    def observe(self, tokens: float, slots: float, seconds: float) -> None:
        x = (1.0, float(tokens), float(slots))
        new = [x[i] * x[j] for i in range(3) for j in range(i, 3)] + [v * seconds for v in x]
        self._moments = new if self._moments is None else [
            smoothed(old, n, self.smoothing) for old, n in zip(self._moments, new)]

    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, b, c), or None while tokens and slots have not varied apart or a part comes out < 0."""
        if self._moments is None:
            return None
        s00, s01, s02, s11, s12, s22, v0, v1, v2 = self._moments
        m = [[s00, s01, s02], [s01, s11, s12], [s02, s12, s22]]
        det = _det3(m)
        if det <= 1e-6 * s00 * s11 * s22:  # (near) collinear
            return None
        coef = [_det3([[v if k == col else m[r][k] for k in range(3)] for r, v in enumerate((v0, v1, v2))]) / det
                for col in range(3)]
        return tuple(coef) if coef[1] >= 0 and coef[2] >= 0 else None


def _det3(m: list[list[float]]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


LINE_TRUST = 4.0  # observations' worth of trust a fitted line has against an entry's own figure


def least_squares(xs: list[tuple[float, ...]], ys: list[float], ws: list[float]) -> tuple[float, ...] | None:
    """Weighted least-squares coefficients of y = c . x (Gaussian elimination on the normal
    equations); None with fewer entries than coefficients or (near) collinear x."""
    n = len(xs[0]) if xs else 0
    if len(xs) < n or not n:
        return None
    m = [[sum(w * x[i] * x[j] for x, w in zip(xs, ws)) for j in range(n)]
         + [sum(w * x[i] * y for x, y, w in zip(xs, ys, ws))] for i in range(n)]
    scale = [m[i][i] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-9 * max(scale[col], 1e-30):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col])]
    return tuple(m[i][n] / m[i][i] for i in range(n))


def trusted_line(values: Sequence[float], weights: Sequence[float], least_weight: float) -> list[float]:
    """Each of values[0], values[1], ... (at x = 0, 1, ...) shrunk towards the line fitted through
    all (each weighted by its trust, at least least_weight): (w v + LINE_TRUST line) / (w +
    LINE_TRUST), w its trust. An entry measured once or long ago keeps little of its own figure,
    so one noisy or stale entry can neither lure the policy to its K nor drive it away; one
    measured often and lately keeps most of it, where a line misses the steps in a kernel's cost
    by rows (batch 1, AVX2 host: a verify pass over 5 tokens cost more than one over 6)."""
    line = line_fit(values, [max(w, least_weight) for w in weights])
    return [(w * v + LINE_TRUST * fit) / (w + LINE_TRUST) for v, w, fit in zip(values, weights, line)]


def line_fit(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The weighted least-squares line through values[0], values[1], ... (at x = 0, 1, ...),
    slope at least 0, evaluated at each x (one noisy or stale entry moves it little)."""
    total = sum(weights)
    if not values or total <= 0:
        return list(values)
    sx = sy = sxx = sxy = 0.0
    for x, (v, w) in enumerate(zip(values, weights)):  # one pass: the policy fits three lines a step
        sx += w * x
        sy += w * v
        sxx += w * x * x
        sxy += w * x * v
    mx, my = sx / total, sy / total
    slope = _slope(mx, my, sxx / total, sxy / total) or 0.0
    return [my + slope * (x - mx) for x in range(len(values))]
