"""Named decode points: a shape contract (max context, max batch, page size, prefill chunk, buckets).

Defined in trnd/points.toml (also at configs/points.toml); an operator may add points in
/etc/trnd/points.toml or $TRND_POINTS, which extend or override the packaged ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec


class DecodePoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: str = ""
    max_context: int
    max_batch: int
    page_size: int
    prefill_chunk: int
    decode_buckets: list[int]
    prefill_buckets: list[int]

    def pool_pages_needed(self) -> int:
        """Pages one max-context sequence needs: the least a pool may have."""
        return -(-self.max_context // self.page_size)


class _File(msgspec.Struct):
    points: dict[str, DecodePoint]


def _sources() -> list[Path]:
    paths = [Path(__file__).with_name("points.toml"), Path("/etc/trnd/points.toml")]
    if os.environ.get("TRND_POINTS"):
        paths.append(Path(os.environ["TRND_POINTS"]))
    return [p for p in paths if p.is_file()]


def load_points() -> dict[str, DecodePoint]:
    points: dict[str, DecodePoint] = {}
    for path in _sources():
        try:
            f = msgspec.toml.decode(path.read_bytes(), type=_File)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ValueError(f"{path}: {e}") from None
        for name, p in f.points.items():
            bad = [k for k in ("max_context", "max_batch", "page_size", "prefill_chunk") if getattr(p, k) < 1]
            if bad:
                raise ValueError(f"{path}: points.{name}.{bad[0]} must be >= 1")
            points[name] = msgspec.structs.replace(p, name=name)
    return points


def get_point(name: str) -> DecodePoint:
    points = load_points()
    if name not in points:
        raise ValueError(f"point = {name!r} is not a known decode point (known: {', '.join(sorted(points))})")
    return points[name]
