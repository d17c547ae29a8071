"""Measured bandwidth tables (written by `python -m amsp_dtensor.plan.profile`) as a time model.

The paper's t(op, bytes, mesh): profile the effective bandwidth w(op, bytes, mesh) and
interpolate, t = bytes / w (the AMSP paper's communication model). Here t is interpolated
linearly in (log bytes, log seconds) between measured sizes of the same op and group shape;
below the smallest size the smallest time is used (latency floor), above the largest the
largest size's bandwidth is kept (t grows linearly).

Group shape = (group size n, nodes spanned s1); the rank stride breaks ties when a table
holds several strides with the same shape. A shape the table lacks (e.g. a table from 4 ranks
used for 1024) falls back to an alpha-beta fit of the same op and locality (intra / inter)
from the table: bus bandwidth from the largest size of every entry, latency from the
smallest; such estimates are flagged in `BandwidthTable.extrapolated`.

JSON schema (version "amsp_dtensor.bandwidth/1"):
{
  "schema": "amsp_dtensor.bandwidth/1",
  "backend": "gloo" | "nccl", "device": str, "world_size": int, "ranks_per_node": int,
  "created": ISO time, "iters": int,
  "entries": [
    {"op": "all_gather" | "reduce_scatter" | "all_reduce" | "broadcast" | "all_to_all",
     "group_size": n, "stride": t, "group_ranks_per_node": s0, "group_nodes": s1,
     "inter_node": bool,
     "points": [[nbytes, seconds], ...]   # nbytes: recorder convention (AG output, RS
    }                                     # input, AR/BC tensor, all-to-all input);
                                          # seconds: median over
  ]                                       # repeats of the slowest rank
}
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .comm import AlphaBeta, GroupShape, ring_factor, ring_steps

SCHEMA = "amsp_dtensor.bandwidth/1"
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")

__all__ = ["SCHEMA", "BandwidthTable", "BandwidthTableError", "load_table"]


class BandwidthTableError(ValueError):
    """The bandwidth table is unreadable or does not follow the schema."""


@dataclass
class _Curve:
    sizes: list[float]
    seconds: list[float]

    def time(self, nbytes: float) -> float:
        xs, ys = self.sizes, self.seconds
        if nbytes <= xs[0]:
            return ys[0]
        if nbytes >= xs[-1]:
            return ys[-1] * nbytes / xs[-1]
        i = bisect.bisect_right(xs, nbytes)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        f = (math.log(nbytes) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))


@dataclass
class BandwidthTable:
    """t(op, nbytes, group) from measured points; see the module docstring."""

    meta: dict
    curves: dict[tuple[str, int, int, int], _Curve]  # (op, n, nodes, stride) -> curve
    fits: dict[tuple[str, bool], AlphaBeta] = field(default_factory=dict)
    extrapolated: set = field(default_factory=set)

    def _op(self, op: str) -> str:
        # The profiler measures no all-to-all (the compressed stages' collective): a table
        # without one times it with the reduce-scatter's curves and fit, the op it
        # replaces, which moves the same (n-1)/n of its buffer per rank.
        if op == "all_to_all" and not any(key[0] == op for key in self.curves):
            return "reduce_scatter"
        return op

    def _curve(self, op: str, group: GroupShape) -> _Curve | None:
        op = self._op(op)
        exact = self.curves.get((op, group.size, group.nodes, group.stride))
        if exact is not None:
            return exact
        for (o, n, nodes, _), curve in sorted(self.curves.items()):
            if o == op and n == group.size and nodes == group.nodes:
                return curve
        return None

    def time(self, op: str, nbytes: int, group: GroupShape) -> float:
        if group.size <= 1 or nbytes <= 0:
            return 0.0
        curve = self._curve(op, group)
        if curve is not None:
            return curve.time(nbytes)
        fit = self.fits.get((self._op(op), group.inter_node))
        if fit is None:
            raise BandwidthTableError(
                f"bandwidth table has no {op} measurements "
                f"{'across' if group.inter_node else 'inside'} nodes; re-run "
                "python -m amsp_dtensor.plan.profile on a cluster with that shape"
            )
        self.extrapolated.add((op, group.size, group.nodes))
        return fit.time(op, nbytes, group)

    def covers(self, op: str, group: GroupShape) -> bool:
        return group.size <= 1 or self._curve(op, group) is not None


def _fit(entries: list[dict]) -> dict[tuple[str, bool], AlphaBeta]:
    fits = {}
    groups: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for e in entries:
        n = e["group_size"]
        pts = e["points"]
        small_n, small_t = pts[0]
        big_n, big_t = pts[-1]
        alpha = small_t / max(ring_steps(e["op"], n), 1)
        bw = ring_factor(e["op"], n) * big_n / big_t if big_t > 0 else float("inf")
        groups.setdefault((e["op"], bool(e["inter_node"])), []).append((alpha, bw))
    for (op, inter), vals in groups.items():
        alpha = sum(a for a, _ in vals) / len(vals)
        bw = sum(b for _, b in vals) / len(vals)
        if inter:
            fits[(op, True)] = AlphaBeta(inter_bw=bw, inter_alpha=alpha)
        else:
            fits[(op, False)] = AlphaBeta(intra_bw=bw, intra_alpha=alpha)
    return fits


def _check(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise BandwidthTableError(f"malformed bandwidth table {where}: {msg}")


def parse_table(data, where: str = "") -> BandwidthTable:
    _check(isinstance(data, dict), where, "top level must be a JSON object")
    _check(data.get("schema") == SCHEMA, where, f"'schema' must be {SCHEMA!r}, got {data.get('schema')!r}")
    entries = data.get("entries")
    _check(isinstance(entries, list) and entries, where, "'entries' must be a non-empty list")
    curves = {}
    for i, e in enumerate(entries):
        tag = f"entries[{i}]"
        _check(isinstance(e, dict), where, f"{tag} must be an object")
        _check(e.get("op") in OPS, where, f"{tag}.op must be one of {OPS}, got {e.get('op')!r}")
        for key in ("group_size", "stride", "group_nodes"):
            v = e.get(key)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, where,
                   f"{tag}.{key} must be a positive int, got {v!r}")
        _check(isinstance(e.get("inter_node"), bool), where, f"{tag}.inter_node must be true/false")
        pts = e.get("points")
        _check(isinstance(pts, list) and pts, where, f"{tag}.points must be a non-empty list")
        clean = []
        for j, pt in enumerate(pts):
            ok = (isinstance(pt, (list, tuple)) and len(pt) == 2
                  and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in pt)
                  and pt[0] > 0 and pt[1] > 0 and math.isfinite(pt[1]))
            _check(ok, where, f"{tag}.points[{j}] must be [bytes > 0, seconds > 0], got {pt!r}")
            clean.append((float(pt[0]), float(pt[1])))
        clean.sort()
        _check(len({x for x, _ in clean}) == len(clean), where, f"{tag}.points repeat a size")
        e = dict(e, points=clean)
        entries[i] = e
        curves[(e["op"], e["group_size"], e["group_nodes"], e["stride"])] = _Curve(
            [x for x, _ in clean], [y for _, y in clean]
        )
    meta = {k: v for k, v in data.items() if k != "entries"}
    return BandwidthTable(meta, curves, _fit(entries))


def load_table(path) -> BandwidthTable:
    """Read and validate a profile JSON; raises BandwidthTableError with a one-line reason."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise BandwidthTableError(f"cannot read bandwidth table {p}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BandwidthTableError(
            f"malformed bandwidth table {p}: not JSON ({exc.msg} at line {exc.lineno})"
        ) from None
    return parse_table(data, str(p))
