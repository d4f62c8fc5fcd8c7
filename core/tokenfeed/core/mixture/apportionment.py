"""Apportionment: which source each position of a mixture stream takes, in closed form.

docs/mixtures.md, "Apportionment: which source each position draws from" is the
contract. Pure, and never O(p): any count, due point or run costs
O(sources x segments) whatever the position, O(k) memory.

Definitions (p, x, q are global positions of the endless mixture stream, one window
each; k is the number of sources; segment j's shares are a[j][i] / D[j], spec.py):

* segments own positions: position p belongs to the last segment whose
  ``from_tokens <= p*seq_len``, so segment j starts at position
  ``P_j = ceil(from_tokens_j / seq_len)``. A segment that owns no position (its start
  is the next one's, once rounded up) is dropped.
* target: ``t_i(p)`` = source i's weight summed over positions 0..p-1 (exact).
* due points: item n >= 1 of source i falls due at the first x with ``t_i(x) >= n``;
  item 0 at the first position where the source's weight is positive. Position q
  takes the q-th item in order of (due point, source index). ``c_i(p)`` counts the
  items of source i among positions 0..p-1.

Why this closed form, and how it is computed without walking:

* ``N_i(x)``, the items of source i due at or before x, is
  ``floor(t_i(x)) + [source i started by x]``; ``S(x) = sum_i N_i(x)``. Since
  ``sum_i t_i(x) = x``, ``x < S(x) <= x + k`` (the item at position q is due in
  [q-k+1, q]), and at most one item per source falls due at one x.
* Precomputed once per segment j (exact Python ints): ``NB[j][i] = N_i(P_j - 1)``,
  ``Q_j = S(P_j - 1)`` (positions [Q_j, Q_{j+1}) hold exactly the items due in
  segment j), ``g[j][i] = floor(D * frac(t_i(P_j)))`` and ``h[j][i]`` (item due at
  P_j itself). Inside segment j, with ``d = x - P_j >= 0``,
  ``N_i(x) - NB[j][i] = M_i(d) = h_i + floor((g_i + a_i*d) / D)``: only the integer
  ``g_i`` of the fractional start is needed, so all arithmetic is on integers.
* ``c(p)``: find j with ``Q_j <= p < Q_{j+1}``, then the smallest d with
  ``sum_i M_i(d) >= p - Q_j``; it lies in a window of k values (binary search), and
  the items due at that d are taken in source order. O(k log k + log segments), no
  dependence on p, O(1) memory.
* The due point of a given item inverts M_i: ``d = ceil((D*u - g_i) / a_i)``.

int64 and exactness: with ``D <= 2**31`` the kernels are int64, reducing d modulo D
first when ``a*d`` could overflow (``a*d = a*D*(d//D) + a*(d%D)``, products < D**2).
Weights with many significant digits (float shares like n_i/total) give D up to
~10**20; there a call anchors at its smallest d with exact Python ints
(``g + a*d0 = q0*D + r0``) and evaluates ``q0 + floor(r0/D + (a/D)*(d - d0))`` in
float64 over a span of at most 2**32, recomputing exactly (Python ints) every element
whose float lies within the float's error bound of an integer; wider spans use numpy
object arrays of Python ints. Results are exact in every mode.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from tokenfeed.core.errors import InvalidArgument
from tokenfeed.core.limits import MAX_TOKENS
from tokenfeed.core.mixture.prefix import Prefix
from tokenfeed.core.mixture.spec import Segment

log = logging.getLogger(__name__)

_FAST_D = 1 << 31  # D <= this: every product of the kernels fits int64
_ANCHOR_SPAN = 1 << 32  # large D: floats near an exact anchor over at most this span
_SPAN_BY_ITEMS = 1 << 17  # counts_every walks at most this many positions in due order
_EVERY_KEPT = 8  # counts_every's last results kept (the ranks of a job ask the same)


@dataclass(frozen=True)
class _Kept:
    """A segment that owns positions, with everything the closed form needs (exact ints)."""

    index: int  # index among all segments (0 = the base mixture)
    P: int  # first position
    D: int
    a: tuple[int, ...]
    g: tuple[int, ...]  # floor(D * frac(t_i(P)))
    h: tuple[int, ...]  # 1 if an item of source i falls due at P itself
    NB: tuple[int, ...]  # N_i(P - 1) = c_i(Q)
    Q: int  # S(P - 1): first position whose item is due in this segment
    Tn: tuple[int, ...]  # t_i(P) = Tn[i] / den
    den: int
    first: tuple[int, ...]  # each source's first position with a positive weight so far, or -1

    @property
    def G(self) -> int:
        return sum(self.g)

    @property
    def H(self) -> int:
        return sum(self.h)


class Apportionment:
    """The closed form of a mixture's segments: counts c(p), due order, targets.

    `segments` in order (segment 0 from token 0), each source's shares `a / D`;
    `seq_len` turns their from_tokens into positions. `extending`, an Apportionment
    (same seq_len) whose first `common` segments are those of `segments`, lends its
    work on them: a segment appended to a long schedule costs O(sources), not
    O(segments) (run-time weights, runtime.py).
    """

    def __init__(
        self,
        segments: Sequence[Segment],
        seq_len: int,
        *,
        extending: Apportionment | None = None,
        common: int = 0,
    ) -> None:
        self.segments = segments
        self.seq_len = seq_len
        self.k = len(self.segments[0].a)
        # each kept segment's kernel parameters, made when a call first needs them
        self._prm: dict[int, tuple[dict[str, Any], str]] = {}
        # counts_every's last results: every rank of a job opens its stream at the same
        # step and asks for the same boundaries (computed once for an epoch-start storm
        # of 1,024 ranks, not once per rank: ~10 ms each at 1,000 sources)
        self._every: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()
        # the kept segments, and their index in `segments`, first position P and first
        # position Q of their items; shared with the Apportionment extended (prefix.py)
        self._segs: Prefix[_Kept]
        self._index: Prefix[int]
        self._P: Prefix[int]
        self._Q: Prefix[int]
        self._build(extending, common)

    def _build(self, extending: Apportionment | None, common: int) -> None:
        """Per segment that owns positions, the exact integers of the closed form (module
        docstring): a fold over the segments, resumed after the last kept segment that
        `extending` computed with the same segments up to the one after it.

        t_i(P) is kept as an integer numerator over a running common denominator
        (Fractions cost ~20x more here, and a stream open builds this). Each segment's
        step is a few numpy operations over the k sources: on int64 where every product
        it makes stays below 2**62, else on Python ints (object arrays), the same
        code either way."""
        k, L, segments = self.k, self.seq_len, self.segments
        n = len(segments)
        reuse = 0  # kept segments taken as they are: whether segment j owns a position
        # depends on segment j + 1, so those before segment common - 1 stay valid, and
        # segment common - 1 too if the segment after it still starts later
        if extending is not None and common > 1:
            reuse = extending._index.bisect_left(common - 1)
            if (
                reuse < len(extending._index)
                and extending._index[reuse] == common - 1
                and (common == n or -(-segments[common].from_tokens // L) > extending._P[reuse])
            ):
                reuse += 1
        Tn: np.ndarray = np.zeros(k, dtype=np.int64)  # t_i(P) = Tn[i] / den
        den = 1
        first = np.full(k, -1, dtype=np.int64)  # first position with positive weight; -1: none
        prev: tuple[np.ndarray, int] | None = None
        prev_P, j0 = 0, 0
        if reuse:
            assert extending is not None
            last = extending._segs[reuse - 1]
            Tn, den = np.array(last.Tn, dtype=object), last.den
            first = np.array(last.first, dtype=np.int64)
            prev, prev_P, j0 = (np.array(last.a, dtype=object), last.D), last.P, last.index + 1
        new: list[_Kept] = []
        P_next = -(-segments[j0].from_tokens // L) if j0 < n else 0
        for j in range(j0, n):
            P = P_next
            if j + 1 < n:
                P_next = -(-segments[j + 1].from_tokens // L)
                if P_next <= P:
                    continue  # owns no position: the next segment starts there too
            seg = segments[j]
            D = seg.D
            pD = 1 if prev is None else prev[1]
            new_den = math.lcm(den, pD)
            # every value below is at most P * new_den * max(D, pD) (t_i <= P)
            exact: Any = object if max(P, 1) * new_den * max(D, pD) >= 1 << 62 else np.int64
            Tn = Tn.astype(exact, copy=False)
            a = np.array(seg.a, dtype=exact)
            if prev is not None:
                pa = prev[0].astype(exact, copy=False)
                up, add = new_den // den, (new_den // pD) * (P - prev_P)
                Tn, den = Tn * up + pa * add, new_den
            first = np.where((first < 0) & (a > 0), P, first)
            F = Tn // den
            g = (Tn - F * den) * D // den
            started_at = ((first >= 0) & (first <= P)).astype(exact)
            if prev is None:
                NB = np.zeros(k, dtype=exact)
            else:  # t_i(P - 1) = Tn/den - pa/pD
                started_before = ((first >= 0) & (first <= P - 1)).astype(exact)
                NB = (Tn * pD - pa * den) // (den * pD) + started_before
            h = F + started_at - NB
            nb = NB.tolist()
            new.append(
                _Kept(
                    j,
                    P,
                    D,
                    seg.a,
                    tuple(g.tolist()),
                    tuple(h.tolist()),
                    tuple(nb),
                    sum(nb),
                    tuple(Tn.tolist()),
                    den,
                    tuple(first.tolist()),
                )
            )
            prev, prev_P = (a, D), P
        if extending is not None and reuse:
            old = extending
            self._segs = old._segs.grown(reuse, new)
            self._index = old._index.grown(reuse, [s.index for s in new])
            self._P = old._P.grown(reuse, [s.P for s in new])
            self._Q = old._Q.grown(reuse, [s.Q for s in new])
        else:
            self._segs = Prefix(new)
            self._index = Prefix([s.index for s in new])
            self._P = Prefix([s.P for s in new])
            self._Q = Prefix([s.Q for s in new], ints=True)
        log.debug(
            "mixture of %d sources, %d segments (%d kept, %d computed)",
            k,
            n,
            len(self._segs),
            len(new),
        )

    @property
    def _fast(self) -> np.ndarray:
        """Per kept segment: True where its kernels run in int64 (D <= 2**31)."""
        return np.array([s.D <= _FAST_D for s in self._segs], dtype=bool)

    # ................................................................. exact, scalar

    @property
    def max_position(self) -> int:
        """The last position whose tokens stay within MAX_TOKENS."""
        return MAX_TOKENS // self.seq_len

    def check_position(self, p: int, field: str = "position") -> int:
        """`p` as an int, or InvalidArgument naming `field` unless it is a position."""
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
            raise InvalidArgument.at(field, f"must be an integer, got {p!r}")
        p = int(p)
        if not 0 <= p <= self.max_position:
            raise InvalidArgument.at(
                field, f"must be in [0, {self.max_position}] (2**62 tokens / seq_len), got {p}"
            )
        return p

    def segment_of(self, p: int) -> int:
        """Index in `segments` of the segment that position p belongs to."""
        p = self.check_position(p)
        return self._segs[self._P.bisect_right(p) - 1].index

    def target(self, p: int) -> tuple[Fraction, ...]:
        """t_i(p): each source's weight summed over positions 0..p-1, exactly."""
        p = self.check_position(p)
        s = self._segs[self._P.bisect_right(p) - 1]
        share = self.segments[s.index].shares
        return tuple(Fraction(t, s.den) + w * (p - s.P) for t, w in zip(s.Tn, share, strict=True))

    def counts(self, p: int) -> tuple[int, ...]:
        """c_i(p): how many of positions 0..p-1 come from each source (exact ints).

        O(k log k + log segments) time, O(k) memory, whatever p is.
        """
        p = self.check_position(p)
        s = self._segs[self._Q.bisect_right(p) - 1]
        r = p - s.Q
        a, g, h, D, k = s.a, s.g, s.h, s.D, self.k

        def M(d: int) -> list[int]:
            if d < 0:
                return [0] * k
            return [h[i] + (g[i] + a[i] * d) // D for i in range(k)]

        lo_u = r - s.H - s.G // D
        lo, hi = max(0, lo_u), max(0, lo_u + k - 1)
        while lo < hi:
            mid = (lo + hi) // 2
            if sum(M(mid)) >= r:
                hi = mid
            else:
                lo = mid + 1
        prev, cur = M(lo - 1), M(lo)
        extra = r - sum(prev)
        out = []
        for i in range(k):
            take = 1 if cur[i] > prev[i] and extra > 0 else 0
            extra -= take
            out.append(s.NB[i] + prev[i] + take)
        return tuple(out)

    # ........................................................... vectorized kernels

    def _params(self, j: int) -> tuple[dict[str, Any], str]:
        """Kept segment j's parameters as [1, k] arrays and scalars, and the kernel mode:
        "fast" (int64, D <= 2**31) or "anchored" (a large D: floats near an exact
        anchor, fixed up exactly wherever the float is ambiguous). Made when first asked
        for: a stream touches the few segments around its position, whatever their number."""
        made = self._prm.get(j)
        if made is not None:
            return made
        s = self._segs[j]
        fast = s.D <= _FAST_D
        exact = np.int64 if fast else object  # a and g: Python ints when D is large
        prm = {
            "a": np.array([list(s.a)], dtype=exact),
            "g": np.array([list(s.g)], dtype=exact),
            "h": np.array([s.h], dtype=np.int64),
            "NB": np.array([s.NB], dtype=np.int64),
            "D": s.D,
            "GD": s.G // s.D,
            "H": s.H,
            "P": s.P,
            "Q": s.Q,
            "seg": j,
        }
        made = prm, "fast" if fast else "anchored"
        if len(self._prm) >= 256:  # bounded: a long stream moves on through the segments
            self._prm.clear()
        self._prm[j] = made
        return made

    def _floors(
        self, prm: dict[str, Any], mode: str, d_min: int, d_max: int
    ) -> Callable[[np.ndarray], np.ndarray]:
        """A function d [m] -> floor((g_i + a_i*d) / D) [m, k] int64, exact, for d in
        [d_min, d_max] (0 <= d, relative to the segment start)."""
        a, g, D = prm["a"], prm["g"], prm["D"]
        if mode == "fast":
            # computed as [k, m] (a source's floors contiguous) and returned as its [m, k]
            # view: numpy loops along the last axis, and k is a few sources against m
            # positions (a [m, k] broadcast of [1, k] runs m loops of k: ~3x the time)
            aT, gT = a.T, g.T
            if int(a.max()) * d_max < 1 << 62:  # a*d fits int64 as it is

                def direct_floors(d: np.ndarray) -> np.ndarray:
                    return ((gT + aT * d) // D).T

                return direct_floors

            def reduced_floors(d: np.ndarray) -> np.ndarray:
                q, rho = d // D, d % D  # a*rho < D**2 <= 2**62
                return (aT * q + (gT + aT * rho) // D).T

            return reduced_floors
        s = self._segs[prm["seg"]]
        if d_max - d_min <= _ANCHOR_SPAN:
            # floor((g + a*d) / D) = q0 + floor(r0/D + (a/D)*(d - d_min)), q0 and r0 exact
            Dp = s.D
            q0, r0 = zip(
                *(divmod(gi + ai * d_min, Dp) for ai, gi in zip(s.a, s.g, strict=True)), strict=True
            )
            q0_np = np.array(q0, dtype=np.int64)
            # a = 0: y = 0.5, floor 0, never ambiguous (r0 < D, so the exact floor is 0)
            r0f = np.array([x / Dp if ai else 0.5 for x, ai in zip(r0, s.a, strict=True)])
            wf = np.array([x / Dp for x in s.a])
            tol = (8 + 4 * (d_max - d_min)) * 2.0**-52  # > the float's error bound

            def anchored_floors(d: np.ndarray) -> np.ndarray:
                delta = d - d_min
                y = r0f + wf * delta[:, None]
                out = q0_np + np.floor(y).astype(np.int64)
                amb = np.abs(y - np.rint(y)) <= tol
                if amb.any():  # y within tol of an integer: decide exactly
                    rows, cols = np.nonzero(amb)
                    for rr, cc in zip(rows.tolist(), cols.tolist(), strict=True):
                        out[rr, cc] = q0[cc] + (r0[cc] + s.a[cc] * int(delta[rr])) // Dp
                return out

            return anchored_floors

        def object_floors(d: np.ndarray) -> np.ndarray:
            dd = d.astype(object)
            return ((g + a * dd[:, None]) // D).astype(np.int64)

        return object_floors

    def check_positions(self, p: np.ndarray, field: str) -> np.ndarray:
        """`p` as int64, or InvalidArgument naming `field` unless all are positions."""
        p = np.asarray(p)
        if p.dtype.kind not in "iu":
            raise InvalidArgument.at(field, f"must be integers, got dtype {p.dtype}")
        p = p.astype(np.int64, copy=False)
        if p.size and (int(p.min()) < 0 or int(p.max()) > self.max_position):
            raise InvalidArgument.at(field, f"positions must be in [0, {self.max_position}]")
        return p

    def counts_at(self, positions: np.ndarray) -> np.ndarray:
        """c(p) for an array of positions: int64 [len(positions), k]. A few numpy calls
        on [len, k] arrays per segment touched (no dependence on the positions' size)."""
        p = self.check_positions(positions, "positions").reshape(-1)
        if p.size == 0:
            return np.zeros((0, self.k), dtype=np.int64)
        seg = np.searchsorted(self._Q.array, p, side="right") - 1
        return self._counts_by_segment(p, seg)

    def counts_every(self, start: int, step: int, n: int) -> np.ndarray:
        """c(start + step*s) for s = 0..n: int64 [n + 1, k] (a round's step boundaries),
        read-only: the last _EVERY_KEPT are kept. The caller checked the positions."""
        key = (int(start), int(step), int(n))
        out = self._every.get(key)
        if out is None:
            out = self._counts_every(*key)
            out.setflags(write=False)
            self._every[key] = out
            while len(self._every) > _EVERY_KEPT:  # another thread may have popped one
                self._every.popitem(last=False)
        return out

    def _counts_every(self, start: int, step: int, n: int) -> np.ndarray:
        """counts_every, computed. Where the steps are short against the sources
        (step < k log k) and few, from c(start) and the sources of positions
        [start, start + step*n) in due order: a search per boundary costs O(k log k), a
        position O(log) (1,000 sources, steps of 8: ~20x less)."""
        k, span = self.k, step * n
        if not 0 < span <= _SPAN_BY_ITEMS or step > k * max(1, (k - 1).bit_length()):
            return self.counts_at(start + step * np.arange(n + 1, dtype=np.int64))
        src, _ = self.items(start, start + span)
        first = self.counts_at(np.array([start], dtype=np.int64))[0]
        cell = np.arange(span, dtype=np.int64) // step * k + src  # (step s, source i)
        per = np.bincount(cell, minlength=n * k).reshape(n, k)
        out = np.empty((n + 1, k), dtype=np.int64)
        out[0] = first
        for s in range(n):  # row by row: numpy's cumsum down a column is ~8x slower here
            np.add(out[s], per[s], out=out[s + 1])
        return out

    def _counts_by_segment(self, p: np.ndarray, seg: np.ndarray) -> np.ndarray:
        """c(p), p[n] computed in segment seg[n] (Q_seg <= p <= Q_{seg+1})."""
        first = int(seg[0])
        if (seg == first).all():
            return self._counts_kernel(p, first)
        out = np.empty((len(p), self.k), dtype=np.int64)
        for j in np.unique(seg).tolist():
            sel = seg == j
            out[sel] = self._counts_kernel(p[sel], j)
        return out

    def _counts_kernel(self, p: np.ndarray, j: int) -> np.ndarray:
        prm, mode = self._params(j)
        k, h, H = self.k, prm["h"], prm["H"]
        r = p - prm["Q"]
        # the smallest d with sum_i M_i(d) >= r lies in [lo_u, lo_u + k - 1]
        lo_u = r - H - prm["GD"]
        lo = np.maximum(lo_u, 0)
        hi = np.maximum(lo_u + (k - 1), lo)
        floors = self._floors(prm, mode, max(0, int(lo.min()) - 1), int(hi.max()))
        for _ in range(max(0, (k - 1).bit_length())):
            mid = (lo + hi) // 2
            ok = H + floors(mid).sum(axis=1) >= r
            hi = np.where(ok, mid, hi)
            lo = np.where(ok, lo, mid + 1)
        d = lo
        cur = h + floors(d)
        prev = np.where((d >= 1)[:, None], h + floors(np.maximum(d - 1, 0)), 0)
        due = cur - prev
        extra = r - prev.sum(axis=1)
        take = (due > 0) & (np.cumsum(due, axis=1) <= extra[:, None])
        return prm["NB"] + prev + take

    def _due(self, prm: dict[str, Any], mode: str, src: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Due point (relative to the segment start) of the item that needs u items from
        the floor term: the least d with floor((g + a*d) / D) >= u; 0 where u <= 0."""
        pos = u > 0
        if not pos.any():
            return np.zeros(len(u), dtype=np.int64)
        a, g, D = prm["a"][0][src], prm["g"][0][src], prm["D"]
        if mode == "fast":
            safe_a = np.where(a > 0, a, 1)
            qa, v = u // safe_a, u % safe_a  # D*v < D**2 <= 2**62
            d = D * qa + (D * v - g + safe_a - 1) // safe_a
            return np.where(pos, d, 0)
        s, k, big = self._segs[prm["seg"]], self.k, np.iinfo(np.int64).max
        # anchor: per source, its smallest u; (D*u0 - g) / a = e0 + f0/a exactly, and
        # d(u) = e0 + ceil(f0/a + (u - u0) * D/a)
        u0 = np.full(k, big, dtype=np.int64)
        np.minimum.at(u0, src[pos], u[pos])
        e0 = np.zeros(k, dtype=np.int64)
        frac0, step = np.zeros(k), np.zeros(k)
        for i in np.flatnonzero(u0 != big).tolist():
            e, f = divmod(s.D * int(u0[i]) - s.g[i], s.a[i])  # a > 0: u > 0 needs it
            e0[i], frac0[i], step[i] = e, f / s.a[i], s.D / s.a[i]
        z = np.where(pos, frac0[src] + (u - np.where(pos, u0[src], 0)) * step[src], 0.0)
        zmax = float(np.abs(z).max())
        if zmax <= _ANCHOR_SPAN:
            d = e0[src] + np.ceil(z).astype(np.int64)
            amb = pos & (np.abs(z - np.rint(z)) <= (8 + 4 * zmax) * 2.0**-52)
            for n in np.flatnonzero(amb).tolist():
                i = int(src[n])
                d[n] = -((s.g[i] - s.D * int(u[n])) // s.a[i])
            return np.where(pos, d, 0)
        uo = u.astype(object)
        safe_a = np.where(a > 0, a, 1)
        return np.where(pos, -((g - D * uo) // safe_a), 0).astype(np.int64)

    def _split_runs(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, ...]:
        """Cut runs [start, stop) at segment boundaries (positions Q_j): each part's
        items are due in one segment. Returns (starts, stops, segment) of the parts,
        in run order."""
        seg_a = np.searchsorted(self._Q.array, starts, side="right") - 1
        seg_b = np.searchsorted(self._Q.array, stops - 1, side="right") - 1
        if np.array_equal(seg_a, seg_b):
            return starts, stops, seg_a
        s_out, e_out, g_out = [], [], []
        for a, b, ja, jb in zip(
            starts.tolist(), stops.tolist(), seg_a.tolist(), seg_b.tolist(), strict=True
        ):
            for j in range(ja, jb + 1):
                lo = a if j == ja else self._Q[j]
                hi = b if j == jb else self._Q[j + 1]
                if hi > lo:
                    s_out.append(lo)
                    e_out.append(hi)
                    g_out.append(j)
        return (
            np.array(s_out, dtype=np.int64),
            np.array(e_out, dtype=np.int64),
            np.array(g_out, dtype=np.int64),
        )

    def runs(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions [start, start + length) for each start, in due order: (source index,
        item index) int64 arrays of shape [len(starts), length]."""
        starts = self.check_positions(np.asarray(starts).reshape(-1), "starts")
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
            raise InvalidArgument.at("length", f"must be a non-negative integer, got {length!r}")
        R = len(starts)
        if R == 0 or length == 0:
            z = np.zeros((R, int(length)), dtype=np.int64)
            return z, z.copy()
        stops = starts + int(length)
        self.check_positions(stops, "stops")
        src, item = self._due_order(starts, stops)
        return src.reshape(R, int(length)), item.reshape(R, int(length))

    def items(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions [start, stop) in due order: (source index, item index) int64 arrays."""
        start = self.check_position(start, "start")
        stop = self.check_position(stop, "stop")
        if stop < start:
            raise InvalidArgument.at("stop", f"must be >= start={start}, got {stop}")
        if stop == start:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return self._due_order(np.array([start], dtype=np.int64), np.array([stop], dtype=np.int64))

    def _due_order(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Concatenated positions of the runs [starts, stops), in due order."""
        starts, stops, seg = self._split_runs(starts, stops)
        first = int(seg[0])
        if (seg == first).all():
            return self._due_order_in(starts, stops, first)
        lengths = stops - starts
        at = np.cumsum(lengths) - lengths
        src = np.empty(int(lengths.sum()), dtype=np.int64)
        item = np.empty_like(src)
        for j in np.unique(seg).tolist():
            sel = np.flatnonzero(seg == j)
            s, i = self._due_order_in(starts[sel], stops[sel], j)
            where = np.repeat(at[sel] - (np.cumsum(lengths[sel]) - lengths[sel]), lengths[sel])
            where += np.arange(len(s))
            src[where], item[where] = s, i
        return src, item

    def _due_order_in(
        self, starts: np.ndarray, stops: np.ndarray, j: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Runs whose items all fall due in segment j, concatenated, in due order."""
        k, n_runs = self.k, len(starts)
        c = self._counts_kernel(np.concatenate([starts, stops]), j)
        c_a, c_b = c[:n_runs], c[n_runs:]
        cnt = (c_b - c_a).ravel()
        total = int(cnt.sum())
        lengths = stops - starts
        flat_src = np.repeat(np.tile(np.arange(k, dtype=np.int64), n_runs), cnt)
        first = np.cumsum(cnt) - cnt
        within = np.arange(total, dtype=np.int64) - np.repeat(first, cnt)
        item = np.repeat(c_a.ravel(), cnt) + within
        prm, mode = self._params(j)
        # u: items the floor term must supply (h covers an item due at d = 0)
        u = item - (prm["NB"][0] + prm["h"][0] - 1)[flat_src]
        d = self._due(prm, mode, flat_src, u)
        # order: run, then due point, then source. Due points of a run [s, e) lie in
        # [s - k + 1, e - 1], so (x - s + k - 1) is in [0, length + k - 1).
        rel = (prm["P"] + d) - (np.repeat(starts, lengths) - (k - 1))
        span = lengths + (k - 1)
        base = (np.cumsum(span) - span) * k
        key = np.repeat(base, lengths) + rel * k + flat_src
        order = np.argsort(key, kind="stable")
        return flat_src[order], item[order]
