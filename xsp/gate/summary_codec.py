"""The packed form of a baseline summary's keys: a few bytes per key.

A summary is committed to a repository for every model a team gates, so its size matters:
written as JSON rows it was about 40% of the trace it came from. Packed, each key table is a
set of integer columns, stored as byte planes and compressed together with one string table
(names, kinds, levels, path segments, shapes and dtypes, each written once):

* a path key is an ancestor's key plus a segment, most often the key's name and an ordinal
  (``.../aten::conv2d[1]``), so no path or name is written twice;
* a layer's name is most often an ancestor's name, a dot and an attribute
  (``model.encoder.layer.0`` below ``model.encoder``): only the attribute is written;
* a parent is most often the previous key or one of its ancestors (keys are listed depth
  first): a small count of steps up;
* a key keeps at most :data:`QUANTILES` samples (evenly spaced quantiles when it had more), as
  offsets from its median on a logarithmic grid whose step is a third of the key's own
  interquartile range (never finer than 0.1%): each comes back within a sixth of that range,
  below the noise a rank test could tell apart, and costs a few bits. They are then scaled so
  that their median is the stored median exactly;
* a median is kept on a logarithmic grid of 0.2%, or of a quarter of its key's sample grid
  where that is coarser (it comes back within half a step: 0.1%, or a 24th of the key's
  interquartile range), and written as the difference from its *reference*: the same key in
  an earlier repeated block (a ResNet stage's bottlenecks, a transformer's layers), else its
  parent (:func:`_references`);
* a total is kept within 0.5% (it is shown, never tested), as the difference from what its
  samples' mean makes it.

:func:`encode` turns key-samples frames (:func:`xsp.gate.statistics.key_samples`) into one
compressed blob; :func:`decode` turns it back.
"""

from __future__ import annotations

import enum
import json
import lzma
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

import numpy as np
import pandas as pd

from xsp.core import schema as col
from xsp.gate import columns as dcol
from xsp.gate.summary_layout import (
    built_on,
    parent_columns,
    parents,
    planes,
    relative,
    unplanes,
)

QUANTILES: Final = 5
"""Samples a key keeps at most (its evenly spaced quantiles when it had more). Odd, so that
the middle one is the key's median."""
VALUE_STEP: Final = 0.002
"""Grid of medians: ``log1p(ns)`` in steps of ``log(1 + VALUE_STEP)``."""
TOTAL_STEP: Final = 0.01
"""Grid of totals, as :data:`VALUE_STEP` is of medians (a total is shown, never tested)."""
FINEST_UNIT: Final = 0.001
"""Finest grid of a key's samples around its median, in log units (0.1%)."""
UNIT_GROWTH: Final = 1.25
"""Ratio between successive sample grids."""
UNITS_PER_IQR: Final = 3
"""A key's sample grid: its interquartile range (in log units) over this, at the finest."""
MEDIAN_STEPS_PER_UNIT: Final = 4
"""A key's median grid: its sample grid over this, at the coarsest (never finer than
:data:`VALUE_STEP`)."""
ENCODING: Final = "xsp-packed-keys-2"
"""2: names built on their ancestors', parents counted up from the previous key, medians
against references, 5 quantiles (7 in summaries made before 2026-11-25, read as they
are); 1 (no longer read: make the summary again): 9 quantiles,
everything whole."""

_LOG_STEP: Final = float(np.log1p(VALUE_STEP))
_TOTAL_LOG_STEP: Final = float(np.log1p(TOTAL_STEP))
_NONE: Final = 0
"""String id of a missing value."""
_ROW_COLUMNS: Final = ("level", "kind", "name", "name_base", "key_base", "key_form", "key_ordinal", "key_segment",
                       "parent", "parent_far", "same_as", "count",
                       "sample_count", "median", "total", "unit", "stored", "lowest", "shapes", "dtypes",
                       "kernels_half")


class _KeyForm(enum.IntEnum):
    """How a key's last part is written (after its base key and a slash, when it has one)."""

    TEXT = 0
    """As a string of the table."""
    NAME = 1
    """It is the key's name (every key by name)."""
    NAME_ORDINAL = 2
    """It is ``name[ordinal]`` (a path's segment)."""
_SAMPLE_COLUMNS: Final = ("gaps",)
_ORDINAL: Final = re.compile(r"\[(0|[1-9][0-9]*)\]")
_DIGITS: Final = re.compile(r"[0-9]+")


class _Strings:
    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def id(self, value: Any) -> int:
        if value is None or (isinstance(value, float) and np.isnan(value)) or value is pd.NA:
            return _NONE
        return self.ids.setdefault(str(value), len(self.ids) + 1)

    def ids_of(self, values: Iterable[Any]) -> np.ndarray:
        return np.fromiter((self.id(value) for value in values), dtype=np.int64)


def _total_codes(totals: np.ndarray) -> np.ndarray:
    return np.rint(np.log1p(np.maximum(totals, 0.0)) / _TOTAL_LOG_STEP).astype(np.int64)


def _totals(codes: np.ndarray) -> np.ndarray:
    return np.expm1(codes * _TOTAL_LOG_STEP)


def _sample_units(exponents: np.ndarray) -> np.ndarray:
    """Each key's sample grid (in log units) from its exponent."""
    return FINEST_UNIT * UNIT_GROWTH ** np.asarray(exponents, dtype=np.float64)


class _Ragged:
    """Rows of different lengths (each key's samples, sorted) as one flat array."""

    def __init__(self, values: np.ndarray, sizes: np.ndarray) -> None:
        self.values, self.sizes = values, sizes.astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64) if len(sizes) else self.sizes
        self.row = np.repeat(np.arange(len(sizes)), self.sizes)

    @classmethod
    def of(cls, samples: Iterable[Any]) -> _Ragged:
        arrays = [np.asarray(values, dtype=np.float64) for values in samples]
        sizes = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        return cls(np.concatenate(arrays) if arrays else np.zeros(0), sizes)

    def quantile(self, q: float) -> np.ndarray:
        """Each row's ``q`` quantile, interpolated as ``np.quantile`` does (0 for an empty row)."""
        return self.quantiles_at(np.arange(len(self.sizes)), np.full(len(self.sizes), q))

    def quantiles_at(self, rows: np.ndarray, q: np.ndarray) -> np.ndarray:
        """The ``q[i]`` quantile of row ``rows[i]``, interpolated as ``np.quantile`` does (0 for an
        empty row)."""
        sizes = self.sizes[rows]
        at = q * np.maximum(sizes - 1, 0)
        low = np.floor(at).astype(np.int64)
        high = np.minimum(low + 1, np.maximum(sizes - 1, 0))
        if not len(self.values):
            return np.zeros(len(rows))
        last = len(self.values) - 1
        below = self.values[np.minimum(self.starts[rows] + low, last)]
        above = self.values[np.minimum(self.starts[rows] + high, last)]
        return np.where(sizes > 0, below + (at - low) * (above - below), 0.0)

    def mean(self) -> np.ndarray:
        sums = np.bincount(self.row, weights=self.values, minlength=len(self.sizes))
        return np.where(self.sizes > 0, sums / np.maximum(self.sizes, 1), 0.0)

    def spread(self) -> np.ndarray:
        return self.quantile(0.75) - self.quantile(0.25)


def _kept_samples(samples: _Ragged) -> _Ragged:
    """At most :data:`QUANTILES` per row: evenly spaced quantiles of the rows that have more."""
    many = samples.sizes > QUANTILES
    if not many.any():
        return samples
    kept_sizes = np.where(many, QUANTILES, samples.sizes)
    kept = _Ragged(np.zeros(int(kept_sizes.sum())), kept_sizes)
    position = np.arange(len(kept.values)) - kept.starts[kept.row]  # within its row
    every = samples.values[samples.starts[kept.row] + position]  # a row with few keeps them all
    kept.values = np.where(many[kept.row], samples.quantiles_at(kept.row, (position + 0.5) / QUANTILES), every)
    return kept


def _decoded_samples(median_codes: np.ndarray, exponents: np.ndarray, codes: _Ragged) -> _Ragged:
    """Each key's samples as they come back from their codes (the encoder and decoder both use
    this, so the encoder knows what the decoder will see)."""
    medians = _medians(median_codes, exponents)
    units = _sample_units(exponents)
    values = np.expm1(np.log1p(medians)[codes.row] + codes.values * units[codes.row])
    middle = _Ragged(values, codes.sizes).quantile(0.5)
    scale = np.where(middle > 0, medians / np.where(middle > 0, middle, 1.0), 1.0)
    return _Ragged(np.rint(values * scale[codes.row]), codes.sizes)  # the stored median, exactly


def _median_steps(exponents: np.ndarray) -> np.ndarray:
    """Each key's grid of its median (in log units): :data:`VALUE_STEP`, or a
    :data:`MEDIAN_STEPS_PER_UNIT` th of its sample grid where that is coarser (a median known
    to a few tenths of its key's own spread is known as well as the runs can tell)."""
    return np.maximum(_LOG_STEP, _sample_units(exponents) / MEDIAN_STEPS_PER_UNIT)


def _medians(median_codes: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    return np.expm1(median_codes * _median_steps(exponents))


def _expected_total_codes(samples: _Ragged, sample_counts: np.ndarray) -> np.ndarray:
    """What each key's total would be if its every sample were the mean of those kept: its total
    is kept as the (small) difference from this."""
    return _total_codes(samples.mean() * sample_counts)


def _sample_columns(samples: _Ragged, sample_counts: np.ndarray, totals: np.ndarray) -> dict[str, np.ndarray]:
    """The statistics columns of one table: medians, totals, sample grids and codes."""
    kept = _kept_samples(samples)
    logs = np.log1p(np.maximum(kept.values, 0.0))
    wanted = np.maximum(_Ragged(logs, kept.sizes).spread() / UNITS_PER_IQR, FINEST_UNIT)
    exponents = np.maximum(np.floor(np.log(wanted / FINEST_UNIT) / np.log(UNIT_GROWTH) + 1e-9), 0).astype(np.int64)
    median_codes = np.rint(np.log1p(np.maximum(kept.quantile(0.5), 0.0)) / _median_steps(exponents)).astype(np.int64)
    logs = logs - np.log1p(_medians(median_codes, exponents))[kept.row]
    codes = np.rint(logs / _sample_units(exponents)[kept.row]).astype(np.int64)
    decoded = _decoded_samples(median_codes, exponents, _Ragged(codes, kept.sizes))
    first = np.zeros(len(codes), dtype=bool)
    first[kept.starts[kept.sizes > 0]] = True
    return {"median": median_codes, "unit": exponents, "stored": kept.sizes,
            "lowest": np.where(kept.sizes > 0, codes[np.minimum(kept.starts, max(len(codes) - 1, 0))] if len(
                codes) else 0, 0),
            "total": _total_codes(totals.astype(np.float64)) - _expected_total_codes(decoded, sample_counts),
            "gaps": np.diff(codes, prepend=0)[~first]}


_STATISTICS: Final = (dcol.COUNT, dcol.TOTAL_NS, dcol.SAMPLE_COUNT, col.INPUT_SHAPES, dcol.INPUT_DTYPES,
                      dcol.KERNELS_PER_STEP)


def _statistics(frame: pd.DataFrame) -> list[list[Any]]:
    """Per row, what two keys must share to stand for each other (one pass over the columns)."""
    columns = [[None if pd.isna(value) else value for value in frame[name].tolist()] if name in frame
               else [None] * len(frame) for name in _STATISTICS]
    return [list(row) for row in zip(*columns)]


def _stand_ins(frame: pd.DataFrame, by_path: pd.DataFrame | None) -> np.ndarray:
    """For each row by name, the row by path with the very same statistics (-1: none): a name
    met at one place only (most layers) is that place's key again."""
    if by_path is None or not len(by_path):
        return np.full(len(frame), -1, dtype=np.int64)
    places: dict[tuple[str, str], list[int]] = {}
    for i, (level, name) in enumerate(zip(by_path[col.LEVEL].tolist(), by_path[col.NAME].tolist())):
        places.setdefault((level, name), []).append(i)
    mine, theirs = _statistics(frame), _statistics(by_path)
    my_samples, their_samples = frame[dcol.SAMPLES_NS].tolist(), by_path[dcol.SAMPLES_NS].tolist()
    found = []
    for i, (level, name) in enumerate(zip(frame[col.LEVEL].tolist(), frame[col.NAME].tolist())):
        at = places.get((level, name), [])
        same = (len(at) == 1 and mine[i] == theirs[at[0]]
                and np.array_equal(my_samples[i], their_samples[at[0]]))
        found.append(at[0] if same else -1)
    return np.asarray(found, dtype=np.int64)


def _table_columns(frame: pd.DataFrame, strings: _Strings, stand_ins: np.ndarray) -> dict[str, np.ndarray]:
    keys = [str(key) for key in frame[dcol.KEY].tolist()]
    names = [str(name) for name in frame[col.NAME].tolist()]
    position = {key: i for i, key in enumerate(keys)}
    parent_at = [position.get(parent, -1) if isinstance(parent, str) else -1 for parent in frame[dcol.PARENT_KEY]]
    structure: dict[str, list[int]] = {name: [] for name in ("name", "name_base", "key_base", "key_form",
                                                             "key_ordinal", "key_segment")}
    for i, (key, name) in enumerate(zip(keys, names)):
        hops, base = built_on(names, parent_at, i, ".")
        structure["name_base"].append(hops)
        structure["name"].append(strings.id(name[len(names[base]) + 1:] if base >= 0 else name))
        hops, base = built_on(keys, parent_at, i, "/")
        segment = key[len(keys[base]) + 1:] if base >= 0 else key
        ordinal = _ORDINAL.fullmatch(segment, len(name)) if segment.startswith(name) else None
        form = (_KeyForm.NAME if segment == name else _KeyForm.NAME_ORDINAL if ordinal is not None
                else _KeyForm.TEXT)
        structure["key_base"].append(hops)
        structure["key_form"].append(form)
        structure["key_ordinal"].append(int(ordinal.group(1)) if ordinal is not None and form is not _KeyForm.NAME
                                        else 0)
        structure["key_segment"].append(strings.id(segment) if form is _KeyForm.TEXT else _NONE)
    own = stand_ins < 0  # rows that keep statistics of their own
    kernels = frame[dcol.KERNELS_PER_STEP].to_numpy(dtype=np.float64, na_value=np.nan)
    columns = {
        "level": strings.ids_of(frame[col.LEVEL]), "kind": strings.ids_of(frame[col.KIND]),
        **{name: np.asarray(values, dtype=np.int64) for name, values in structure.items()},
        **parent_columns(parent_at),
        "same_as": _stand_in_steps(stand_ins),
        "count": np.where(own, frame[dcol.COUNT].to_numpy(dtype=np.int64), 0),
        "sample_count": np.where(own, frame[dcol.SAMPLE_COUNT].to_numpy(dtype=np.int64), 0),
        "shapes": np.where(own, strings.ids_of(frame[col.INPUT_SHAPES]), _NONE),
        "dtypes": np.where(own, strings.ids_of(frame[dcol.INPUT_DTYPES]), _NONE),
        "kernels_half": np.where(own & ~np.isnan(kernels), np.rint(np.nan_to_num(kernels) * 2) + 1, 0).astype(np.int64),
    }
    statistics = _sample_columns(_Ragged.of(frame[dcol.SAMPLES_NS].to_numpy()[own]), columns["sample_count"][own],
                                 frame[dcol.TOTAL_NS].to_numpy(dtype=np.int64)[own])
    for name in ("median", "total", "unit", "stored", "lowest"):
        full = np.zeros(len(frame), dtype=np.int64)
        full[own] = statistics[name]
        columns[name] = full
    columns["gaps"] = statistics["gaps"]
    texts = {id_: text for text, id_ in strings.ids.items()}
    reference, _ = _references(columns, parent_at, [texts.get(id_, "") for id_ in columns["name"].tolist()])
    return _against_references(columns, reference)


def _against_references(columns: dict[str, np.ndarray], reference: np.ndarray) -> dict[str, np.ndarray]:
    """A key's sample grid and median written as differences from its reference's (the median
    on its own grid: its reference's median, rounded to it)."""
    has = reference >= 0
    at = np.maximum(reference, 0)
    unit, median = columns["unit"], columns["median"]
    steps = _median_steps(unit)
    return {**columns, "unit": np.where(has, unit - unit[at], unit),
            "median": np.where(has, median - _rounded_to(median[at], steps[at], steps), median)}


def _from_references(columns: dict[str, np.ndarray], reference: np.ndarray, order: list[int]) -> dict[str, np.ndarray]:
    """What :func:`_against_references` wrote, whole again (in an order that has each key's
    reference whole before the key)."""
    unit, median = columns["unit"].copy(), columns["median"].copy()
    for row in order:
        at = reference[row]
        if at >= 0:
            unit[row] += unit[at]
            median[row] += _rounded_to(median[at:at + 1], _median_steps(unit[at:at + 1]),
                                       _median_steps(unit[row:row + 1]))[0]
    return {**columns, "unit": unit, "median": median}


def _rounded_to(codes: np.ndarray, steps: np.ndarray, to_steps: np.ndarray) -> np.ndarray:
    return np.rint(codes * steps / to_steps).astype(np.int64)


def _references(columns: Mapping[str, np.ndarray], parent_at: list[int],
                name_parts: list[str]) -> tuple[np.ndarray, list[int]]:
    """For each row that keeps statistics of its own, the row whose median and sample grid its
    own are written against (-1: none), and an order of the rows in which each row's reference
    comes before it. Only what the decoder has before the statistics is used.

    A key most often takes about the time of the same key in a repeated block (a ResNet stage's
    bottlenecks, a transformer's layers), else a little less than its parent (the operators
    ``aten::conv2d``, ``aten::convolution``, ``aten::_convolution`` each call the next): a
    difference of a few bits where a median takes thirteen. A row's *shape* is its level,
    kind, name part (digits aside: ``layers.1`` is shaped as ``layers.2``) and input shapes,
    with the shapes of its children in order; its *place* is its shape and its parent's place.
    The reference is the last row before it of the same place, else its parent. (Choosing the
    nearer of these and the last row of the same shape, and writing the choice, costs more than
    it saves.)"""
    rows = len(name_parts)
    depth = [-1] * rows
    for row in range(rows):  # depth along the parent chain; a chain that comes round stops there
        chain, at, seen = [], row, set()
        while 0 <= at < rows and depth[at] < 0 and at not in seen:
            seen.add(at)
            chain.append(at)
            at = parent_at[at]
        reached = depth[at] if 0 <= at < rows and depth[at] >= 0 else -1
        for at in reversed(chain):
            reached += 1
            depth[at] = reached
    parent = [at if 0 <= at < rows and depth[at] == depth[row] - 1 else -1 for row, at in enumerate(parent_at)]
    children: list[list[int]] = [[] for _ in range(rows)]
    for row in range(rows):
        if parent[row] >= 0:
            children[parent[row]].append(row)
    own = list(zip(columns["level"].tolist(), columns["kind"].tolist(),
                   (_DIGITS.sub("#", part) for part in name_parts), columns["shapes"].tolist()))
    order = sorted(range(rows), key=depth.__getitem__)  # parents before children, rows in order
    ids: dict[tuple[Any, ...], int] = {}
    shape = [0] * rows
    for row in reversed(order):
        shape[row] = ids.setdefault(("shape", own[row], tuple(shape[child] for child in children[row])), len(ids))
    place = [0] * rows
    for row in order:
        place[row] = ids.setdefault(("place", shape[row], place[parent[row]] if parent[row] >= 0 else -1), len(ids))
    keeps = (columns["same_as"] == 0).tolist()  # a row standing in for a key by path keeps no statistics
    last: dict[int, int] = {}
    found = np.full(rows, -1, dtype=np.int64)
    for row in order:  # a place's rows are all at one depth: the last earlier one is met first
        if keeps[row]:
            found[row] = last.get(place[row], parent[row] if parent[row] >= 0 and keeps[parent[row]] else -1)
            last[place[row]] = row
    return found, order


def _stand_in_steps(stand_ins: np.ndarray) -> np.ndarray:
    """Stand-ins (rows by path, -1: none) as steps from the row the last one stood in for, never
    0 (0: none): names are listed in the order their paths are, so most steps are small."""
    steps, last = [], 0
    for at in stand_ins.tolist():
        steps.append(relative(at, last) if at >= 0 else 0)
        last = at if at >= 0 else last
    return np.asarray(steps, dtype=np.int64)


def _stand_ins_from_steps(steps: np.ndarray) -> np.ndarray:
    found, last = [], 0
    for step in steps.tolist():
        at = -1 if step == 0 else last + step - 1 if step > 0 else last + step
        found.append(at)
        last = at if step else last
    return np.asarray(found, dtype=np.int64)


def encode(frames: Mapping[str, pd.DataFrame]) -> bytes:
    """The key tables (by their ``KeyBy`` value) packed and xz-compressed."""
    strings = _Strings()
    header: dict[str, Any] = {"encoding": ENCODING, "quantiles": QUANTILES, "tables": {}}
    body: list[bytes] = []
    by_path = frames.get(dcol.KeyBy.PATH.value)
    for by in sorted(frames, key=lambda by: by != dcol.KeyBy.PATH.value):  # by path first: others refer to it
        frame = frames[by]
        stand_ins = (_stand_ins(frame, by_path) if by == dcol.KeyBy.NAME.value
                     else np.full(len(frame), -1, dtype=np.int64))
        described = []
        for name, values in _table_columns(frame, strings, stand_ins).items():
            width, raw = planes(values)
            described.append([name, width, len(values)])
            body.append(raw)
        header["tables"][by] = {"rows": len(frame), "columns": described}
    header["strings"] = list(strings.ids)
    payload = json.dumps(header, separators=(",", ":")).encode() + b"\0" + b"".join(body)
    return lzma.compress(payload, preset=9 | lzma.PRESET_EXTREME)


def decode(blob: bytes, max_bytes: int) -> dict[str, pd.DataFrame]:
    """The key tables packed by :func:`encode`.

    Raises:
        ValueError: the blob is damaged, truncated, or inflates past ``max_bytes``.
    """
    try:
        inflater = lzma.LZMADecompressor()
        payload = inflater.decompress(blob, max_length=max_bytes + 1)
        while not inflater.eof and not inflater.needs_input and len(payload) <= max_bytes:
            payload += inflater.decompress(b"", max_length=max_bytes + 1 - len(payload))
    except lzma.LZMAError as exc:
        raise ValueError(f"its packed keys are damaged ({exc})") from None
    if len(payload) > max_bytes or not inflater.eof:
        raise ValueError("its packed keys are truncated or inflate past any summary's size")
    split = payload.find(b"\0")
    if split < 0:
        raise ValueError("its packed keys have no header")
    header = json.loads(payload[:split])
    if header.get("encoding") != ENCODING:
        raise ValueError(f"its keys are packed as {header.get('encoding')!r}, which this xsp cannot read"
                         " (make the summary again with this xsp)")
    try:
        texts = [None, *header["strings"]]
        at = split + 1
        frames: dict[str, pd.DataFrame] = {}
        for by, table in header["tables"].items():
            columns: dict[str, np.ndarray] = {}
            for name, width, length in table["columns"]:
                if width not in (1, 2, 4, 8) or length < 0 or at + width * length > len(payload):
                    raise ValueError("its packed keys are cut short")
                columns[name] = unplanes(payload[at:at + width * length], width, length)
                at += width * length
            frames[by] = _frame(int(table["rows"]), columns, texts, frames.get(dcol.KeyBy.PATH.value))
    except (KeyError, IndexError, TypeError, OverflowError) as exc:
        raise ValueError(f"its packed keys are damaged ({type(exc).__name__}: {exc})") from None
    return frames


def _frame(rows: int, columns: dict[str, np.ndarray], texts: list[Any], by_path: pd.DataFrame | None) -> pd.DataFrame:
    missing = [name for name in (*_ROW_COLUMNS, *_SAMPLE_COLUMNS) if name not in columns]
    if missing or any(len(columns[name]) != rows for name in _ROW_COLUMNS):
        raise ValueError("its packed key columns do not match")
    stored = columns["stored"]
    if (stored < 0).any() or int(stored.sum()) != len(columns["gaps"]) + int((stored > 0).sum()):
        raise ValueError("its packed samples do not match their keys")

    def text(name: str) -> list[Any]:
        return [texts[i] for i in columns[name].tolist()]  # IndexError: a damaged table

    parent_at = parents(columns["parent"].tolist(), columns["parent_far"].tolist())
    reference, order = _references(columns, parent_at, [str(part) if part is not None else "" for part in text("name")])
    columns = _from_references(columns, reference, order)
    names, keys, parent_keys = _keys(columns, parent_at, text("name"), text("key_segment"))
    sample_count = columns["sample_count"]
    lowest = columns["lowest"]
    code_values = np.zeros(int(stored.sum()), dtype=np.int64)
    codes = _Ragged(code_values, stored)
    first = np.zeros(len(code_values), dtype=bool)
    first[codes.starts[stored > 0]] = True
    steps = np.zeros(len(code_values), dtype=np.int64)
    steps[first] = lowest[stored > 0]
    steps[~first] = columns["gaps"]
    running = np.cumsum(steps)  # over all rows: each row's codes are this less what came before it
    before_row = np.zeros(len(stored), dtype=np.int64)
    before_row[stored > 0] = (running - steps)[first]
    codes.values = running - before_row[codes.row]
    decoded = _decoded_samples(columns["median"], columns["unit"], codes)
    flat = decoded.values.astype(np.int64)
    samples = [flat[start:start + size] for start, size in zip(decoded.starts.tolist(), decoded.sizes.tolist())]
    total = _totals(columns["total"] + _expected_total_codes(decoded, sample_count))
    kernels = columns["kernels_half"]
    frame = pd.DataFrame({
        col.LEVEL: text("level"), col.KIND: text("kind"), col.NAME: names, dcol.KEY: keys,
        dcol.PARENT_KEY: parent_keys, dcol.COUNT: columns["count"], dcol.TOTAL_NS: np.rint(total).astype(np.int64),
        dcol.SAMPLES_NS: samples, dcol.SAMPLE_COUNT: sample_count, col.INPUT_SHAPES: text("shapes"),
        dcol.KERNELS_PER_STEP: np.where(kernels > 0, (kernels - 1) / 2, np.nan),
        dcol.INPUT_DTYPES: text("dtypes"),
    }, columns=list(dcol.KEY_COLUMNS))
    same_as = _stand_ins_from_steps(columns["same_as"])
    standing_in = np.flatnonzero(same_as >= 0)
    if len(standing_in):
        if by_path is None or int(same_as.max()) >= len(by_path):
            raise ValueError("a packed key stands in for a key by path that is not there")
        statistics = [dcol.COUNT, dcol.TOTAL_NS, dcol.SAMPLES_NS, dcol.SAMPLE_COUNT, col.INPUT_SHAPES,
                      dcol.KERNELS_PER_STEP,
                      dcol.INPUT_DTYPES]
        for column in statistics:
            values = frame[column].to_numpy(dtype=object if column in (dcol.SAMPLES_NS, col.INPUT_SHAPES,
                                                                      dcol.INPUT_DTYPES) else None).copy()
            values[standing_in] = by_path[column].to_numpy()[same_as[standing_in]]
            frame[column] = values
    return frame


def _keys(columns: dict[str, np.ndarray], parent_at: list[int], name_parts: list[Any],
          segments: list[Any]) -> tuple[list[str], list[str], list[str | None]]:
    """Each row's name, key and parent key, rebuilt along the parent chain."""
    names = _joined(_bases(columns["name_base"].tolist(), parent_at), [str(part) for part in name_parts], ".")
    parts = []
    for i, (form, ordinal, segment) in enumerate(zip(columns["key_form"].tolist(), columns["key_ordinal"].tolist(),
                                                     segments)):
        if form == _KeyForm.NAME:
            segment = names[i]
        elif form == _KeyForm.NAME_ORDINAL:
            segment = f"{names[i]}[{ordinal}]"
        elif form != _KeyForm.TEXT:
            raise ValueError(f"a packed key has an unknown form {form}")
        parts.append(str(segment))
    keys = _joined(_bases(columns["key_base"].tolist(), parent_at), parts, "/")
    return names, keys, [keys[at] if at >= 0 else None for at in parent_at]


def _bases(hops_of: list[int], parent_at: list[int]) -> list[int]:
    """The row each row's text is built on, ``hops`` up its parent chain (-1: none)."""
    bases = []
    for i, hops in enumerate(hops_of):
        base = i
        for _ in range(hops):
            base = parent_at[base]
            if base < 0:
                raise ValueError("a packed key's base is above its root")
        bases.append(base if hops else -1)
    return bases


def _joined(bases: list[int], parts: list[str], separator: str) -> list[str]:
    """Each row's text: its base row's text, ``separator`` and its part (its part alone when it
    has no base)."""
    rows = len(parts)
    texts: list[str | None] = [None] * rows
    for row in range(rows):
        chain = []  # the rows whose texts this one's is built on, nearest first
        at = row
        while at >= 0 and texts[at] is None:
            chain.append(at)
            at = bases[at]
            if len(chain) > rows:
                raise ValueError("packed keys are built on each other in a circle")
        for at in reversed(chain):
            base = bases[at]
            texts[at] = f"{texts[base]}{separator}{parts[at]}" if base >= 0 else parts[at]
    return [str(text) for text in texts]
