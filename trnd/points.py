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


# -- what a point promises, checked against the model and the memory (before anything starts) --------

class Capacity(msgspec.Struct, frozen=True):
    """What a role's pool really holds under its point. The point's max_batch is a limit on running
    sequences, not a promise that each can reach max_context at once: the pool is shared by tokens
    ("tokens, not sequences" mode, docs/DEPLOY.md), and this says how far that goes."""
    point: str
    kv_bytes_per_token: int  # per rank, all layers, K and V
    pages: int
    tokens: int  # pages x page_size
    full_length_sequences: float  # tokens / max_context
    max_batch: int
    tokens_per_sequence_at_full_batch: int  # tokens / max_batch

    def line(self) -> str:
        return (f"point {self.point}: pool {self.pages} pages = {self.tokens} tokens "
                f"({self.kv_bytes_per_token} KV bytes per token per rank) = {self.full_length_sequences:.2f} "
                f"full-length sequences; its batch of {self.max_batch} holds "
                f"{self.tokens_per_sequence_at_full_batch} tokens each")


def capacity(point: DecodePoint, page_bytes: int, pages: int) -> Capacity:
    tokens = pages * point.page_size
    return Capacity(point.name, page_bytes // point.page_size, pages, tokens, round(tokens / point.max_context, 3),
                    point.max_batch, tokens // point.max_batch)


def model_positions(max_position_embeddings: int, rope_scaling: dict | None) -> tuple[int, str]:
    """How many positions a model is configured for, and what says so: max_position_embeddings, or a
    RoPE scaling (YaRN, llama3, linear, dynamic) that stretches original_max_position_embeddings by
    its factor, whichever is larger (HF configs write either form)."""
    n, why = max_position_embeddings, f"max_position_embeddings = {max_position_embeddings}"
    s = rope_scaling or {}
    kind, factor, orig = s.get("rope_type", s.get("type")), s.get("factor"), s.get("original_max_position_embeddings")
    if kind and kind != "default" and factor and orig and int(factor * orig) > n:
        n, why = int(factor * orig), f"rope_scaling {kind}: factor {factor} x original_max_position_embeddings {orig}"
    return n, why


def check_positions(point: DecodePoint, max_position_embeddings: int, rope_scaling: dict | None) -> str | None:
    """None when the model reaches the point's max_context; else one line with both numbers. Positions
    past what the model was configured for are never served silently."""
    n, why = model_positions(max_position_embeddings, rope_scaling)
    if point.max_context <= n:
        return None
    return (f"point {point.name!r} serves max_context = {point.max_context} positions, but the model is configured "
            f"for {n} ({why}{'' if rope_scaling else '; no rope_scaling in config.json'}): pick a smaller point, "
            f"or a model whose rope_scaling (YaRN, llama3) reaches {point.max_context}")
