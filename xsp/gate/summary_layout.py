"""How a summary stores its rows compactly: parent links as near or far references, names built
on a base a few parents up, and integers split into byte planes that compress well."""

from __future__ import annotations

from typing import Final

import numpy as np

_NEAR_PARENT: Final = 64
"""How far up the previous row's ancestors a parent is looked for."""


def parent_columns(parent_at: list[int]) -> dict[str, np.ndarray]:
    """Each row's parent (-1: none), as keys listed depth first have it: ``parent`` is 1 for the
    previous row, 2 for its parent, and so on up (0: no parent); -1 when the parent is none of
    these, and then ``parent_far`` says where it is (:func:`relative`)."""
    near, far = [], []
    for row, parent in enumerate(parent_at):
        hops, at = 0, -1
        if parent >= 0 and row > 0:
            at, hops = row - 1, 1
            while at != parent and hops < _NEAR_PARENT:
                up = parent_at[at]
                if not 0 <= up < at:  # the decoder walks up through rows it has already read
                    break
                at, hops = up, hops + 1
        found = parent < 0 or at == parent
        near.append(hops if found else -1)
        far.append(0 if found else relative(row, parent))
    return {"parent": np.asarray(near, dtype=np.int64), "parent_far": np.asarray(far, dtype=np.int64)}


def parents(near: list[int], far: list[int]) -> list[int]:
    """What :func:`parent_columns` wrote: each row's parent (-1: none)."""
    parent_at: list[int] = []
    for row, (hops, where) in enumerate(zip(near, far)):
        if hops < 0:
            at = _absolute(row, where)
        else:
            at = row - 1 if hops else -1
            for _ in range(hops - 1):
                if at < 0:
                    raise ValueError("a packed key names a parent that is not there")
                at = parent_at[at]
        if not -1 <= at < len(near) or (hops > 0 and at < 0):
            raise ValueError("a packed key names a parent that is not there")
        parent_at.append(at)
    return parent_at


def relative(row: int, other: int) -> int:
    """Where ``other`` lies from ``row``, never 0 (0: there is none). A parent most often comes
    just before its child; by name, it may come after it, or be the key itself."""
    if other < 0:
        return 0
    return row - other + 1 if row >= other else row - other


def _absolute(row: int, relative: int) -> int:
    return -1 if relative == 0 else row - (relative - 1) if relative > 0 else row - relative


_BASE_HOPS: Final = 8
"""How far up the parent chain a row's text looks for the text it extends: further bases only
save bytes in rare trees, and looking further costs every row of a deep one."""


def built_on(texts: list[str], parent_at: list[int], row: int, separator: str) -> tuple[int, int]:
    """``(hops, row)`` of the nearest ancestor (at most :data:`_BASE_HOPS` up) whose text and
    ``separator`` begin this row's text (a key and a slash, a name and a dot): hops up the
    parent chain, 1 for the parent (``(0, -1)``: none)."""
    text, at, hops = texts[row], parent_at[row], 1
    seen = {row}
    while at >= 0 and at not in seen and hops <= _BASE_HOPS:  # keys by name can be each other's parents
        if text.startswith(texts[at]) and text[len(texts[at]):len(texts[at]) + 1] == separator:
            return hops, at
        seen.add(at)
        at, hops = parent_at[at], hops + 1
    return 0, -1


def planes(values: np.ndarray) -> tuple[int, bytes]:
    """Zigzag-coded integers, narrowest width, most significant byte plane last (the planes of
    one column lie together, so the compressor sees runs of alike bytes)."""
    array = np.asarray(values, dtype=np.int64)
    zigzag = ((array << 1) ^ (array >> 63)).astype(np.uint64)
    top = int(zigzag.max()) if len(zigzag) else 0
    width = next(w for w in (1, 2, 4, 8) if top < 1 << (8 * w))
    narrow = zigzag.astype(f"<u{width}")
    return width, narrow.view(np.uint8).reshape(-1, width).T.tobytes()


def unplanes(raw: bytes, width: int, length: int) -> np.ndarray:
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(width, length)
    zigzag = np.ascontiguousarray(planes.T).view(f"<u{width}").reshape(length).astype(np.int64)
    return (zigzag >> 1) ^ -(zigzag & 1)
