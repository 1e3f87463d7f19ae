"""The model-level tracer: top-level model calls, the loop's events, user spans and steps."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Final

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level, SpanKind, Status
from xsp.record.columns import BACKWARD_BEGIN
from xsp.record.marks import SPAN_KIND_OF_MARK, MarkKind
from xsp.record.recording import Recording
from xsp.record.steps import GENERATE_SUFFIX, INFERENCE_STEP_NAME, TRAIN_STEP_NAME
from xsp.record.window import Window, WindowBuffer
from xsp.tracers._collectives import Collectives
from xsp.tracers._ddp_buckets import DdpBuckets
from xsp.tracers._loop_events import LoopEvents
from xsp.tracers.module_calls.call_context import Mode
from xsp.tracers.module_calls.lifecycle import ModuleCallTracer
from xsp.tracers.module_calls.rows import as_numpy, module_call_rows, site_columns


class ModelTracer(ModuleCallTracer):
    """Records each call of a top-level nn.Module as a ``predict`` span named by its model;
    the loop's input waits, optimizer steps, backward passes and compilations; torch.distributed
    collectives called from Python; user spans; and the steps, explicit and automatic."""

    name: ClassVar[str] = "model"
    level: ClassVar[Level] = Level.MODEL
    also_records: ClassVar[tuple[Level, ...]] = (Level.INPUT,)
    """The loop's waits for data: the input level."""
    mode: ClassVar[Mode] = Mode.ROOTS

    def __init__(self) -> None:
        self._events: LoopEvents | None = None
        self._collectives: Collectives | None = None
        self._ddp_buckets: DdpBuckets | None = None

    def start(self, recording: Recording) -> None:
        super().start(recording)
        self._events = LoopEvents(recording)
        self._collectives = Collectives(recording)
        self._ddp_buckets = DdpBuckets(recording, self._collectives)
        try:
            self._events.install()
            self._collectives.install()
            self._ddp_buckets.install()
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        events, self._events = self._events, None
        collectives, self._collectives = self._collectives, None
        ddp_buckets, self._ddp_buckets = self._ddp_buckets, None
        try:
            if ddp_buckets is not None:
                ddp_buckets.uninstall()
            if events is not None:
                events.uninstall()
            if collectives is not None:
                collectives.uninstall()
        finally:
            super().stop()

    def collect(self, window: Window) -> pd.DataFrame:
        predicts, marks = _predict_rows(window), mark_rows(window)
        if len(predicts) and len(marks):
            _mark_generate_phases(predicts, marks)
        return pd.concat([predicts, marks], ignore_index=True)


def _predict_rows(window: Window) -> pd.DataFrame:
    calls = module_call_rows(window)
    if calls.empty:
        return calls
    roots = calls[calls[col.CALL_DEPTH] == 0].copy()
    roots[col.LEVEL] = Level.MODEL.value
    roots[col.KIND] = SpanKind.PREDICT.value
    return roots.reset_index(drop=True)


def _mark_generate_phases(predicts: pd.DataFrame, marks: pd.DataFrame) -> None:
    """Model calls inside a ``generate()`` step, by model: an encoder-decoder's encoder, called
    once before the decoder, is the ``encode``; each decoding model's first call is its
    ``prefill``, the rest ``decode`` calls. Where one model decodes, each call has the index of
    the token it produces; an assistant model's calls (assisted generation: several tokens a call
    of the target model) have none."""
    # a generate() step, or (inside an xsp.step) a generate() span
    generates = marks[marks[col.KIND].isin([SpanKind.STEP.value, SpanKind.USER.value])
                      & marks[col.NAME].str.endswith(GENERATE_SUFFIX)]
    for step in generates.itertuples(index=False):
        start, end, thread = getattr(step, col.START_NS), getattr(step, col.END_NS), getattr(step, col.THREAD_ID)
        inside = predicts[(predicts[col.THREAD_ID] == thread) & (predicts[col.START_NS] >= start)
                          & (predicts[col.END_NS] <= end)].sort_values(col.START_NS, kind="stable")
        names = inside[col.NAME].astype(str).tolist()
        rows = inside.index.tolist()
        calls = {name: names.count(name) for name in names}
        first = names[0] if names else None
        encoder = first if first is not None and calls[first] == 1 and len(calls) > 1 else None
        decoding = [name for name in calls if name != encoder]
        seen: dict[str, int] = {}
        for name, row in zip(names, rows):
            attributes = json.loads(predicts.at[row, col.ATTRIBUTES] or "{}")
            if name == encoder:
                attributes[col.ATTR_GENERATE_PHASE] = GENERATE_ENCODE
            else:
                index = seen.get(name, 0)
                seen[name] = index + 1
                attributes[col.ATTR_GENERATE_PHASE] = "prefill" if index == 0 else "decode"
                if len(decoding) == 1:
                    attributes[col.ATTR_GENERATE_TOKEN] = index
            predicts.at[row, col.ATTRIBUTES] = json.dumps(attributes)


GENERATE_ENCODE: Final = "encode"
"""The phase of an encoder-decoder's encoder call inside ``generate()``."""


def _attributes_json(attributes: dict[str, Any] | None) -> str | None:
    if not attributes:
        return None
    return json.dumps({key: _attribute_value(value) for key, value in attributes.items()})


def _attribute_value(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, bool, int, float)) for v in value):
        return list(value)
    return str(value)


def _nested_backward(mark_kinds: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Backward passes run inside another one (a reentrant checkpoint's backward of its
    recomputed block): part of the outer pass, not passes of their own."""
    nested = np.zeros(len(mark_kinds), dtype=bool)
    rows = np.flatnonzero(mark_kinds == MarkKind.BACKWARD)
    if len(rows) < 2:
        return nested
    rows = rows[np.lexsort((-ends[rows], starts[rows]))]
    latest_end_before = np.maximum.accumulate(np.concatenate(([np.iinfo(np.int64).min], ends[rows][:-1])))
    nested[rows] = latest_end_before >= ends[rows]
    return nested


def _backward_begins(window: Window) -> tuple[np.ndarray, np.ndarray]:
    """The backward begins of the window's module calls, on any thread (on a GPU the nodes run on
    an autograd device thread): each one's forward call's start, and its time, by call start."""
    calls, times = [], []
    for buffer in window.buffers:
        cols = buffer.backward_columns
        if len(cols):
            begin = as_numpy(cols.phase) == BACKWARD_BEGIN
            calls.append(as_numpy(cols.call)[begin])
            times.append(as_numpy(cols.time)[begin])
    if not calls:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    call, time = np.concatenate(calls), np.concatenate(times)
    order = np.argsort(call, kind="stable")
    return call[order], time[order]


def _joined_first_calls(buffer: WindowBuffer, begins: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Where each of the thread's marks starts, and which it keeps: a training step takes in the
    model calls just before it that were steps of their own (an inference step of one call, or
    one with its input wait) when their backward ran in its time. The first iteration of a model
    called several times before its first backward (a siamese encoder on two views, an
    ``nn.LSTMCell`` stepped over a sequence) cannot be told, call by call, from an evaluation with
    autograd left on, so its first calls were decided as steps of their own; the backward pass
    says they were this step's: the backward of a call inside them began in its time."""
    cols = buffer.mark_columns
    starts, ends = as_numpy(cols.start), as_numpy(cols.end)
    keep = np.ones(len(starts), dtype=bool)
    kinds = as_numpy(cols.kind)
    steps = np.flatnonzero(kinds == MarkKind.STEP)
    roots = buffer.root_columns
    begin_calls, begin_times = begins
    if not len(begin_calls) or not len(steps) or not len(roots):
        return starts, keep
    name_of = as_numpy(cols.name)
    names = {step: buffer.strings.values[name_of[step]] for step in steps.tolist()}
    root_starts = np.sort(as_numpy(roots.start))
    steps = steps[np.argsort(starts[steps], kind="stable")]
    trains = np.array([names[step] == TRAIN_STEP_NAME for step in steps.tolist()], dtype=bool)
    # each step's floor: the latest end of the steps before it, an inference step's left out (it
    # may be one of those calls with its input wait)
    bounding = np.where(np.array([names[step] != INFERENCE_STEP_NAME for step in steps.tolist()], dtype=bool),
                        ends[steps], np.iinfo(np.int64).min)
    floors = np.maximum.accumulate(np.concatenate(([np.iinfo(np.int64).min], bounding[:-1])))
    before = (np.searchsorted(root_starts, starts[steps], side="left")
              - np.searchsorted(root_starts, floors, side="left"))
    new_starts = starts.copy()
    candidates = np.flatnonzero(trains & (before > 0))  # training steps with calls before them
    if not len(candidates):
        return starts, keep
    calls = buffer.call_columns
    top = as_numpy(calls.depth) == 0
    root_ends = dict(zip(as_numpy(calls.start)[top].tolist(), as_numpy(calls.end)[top].tolist()))
    for order in candidates.tolist():
        step = int(steps[order])
        step_start, step_end = int(starts[step]), int(ends[step])
        earlier = steps[:order]
        first = step_start
        lo = int(np.searchsorted(root_starts, floors[order], side="left"))
        for root in root_starts[lo:lo + int(before[order])][::-1].tolist():
            end = root_ends.get(root)
            if end is None or end > step_start:
                break
            inside = begin_times[np.searchsorted(begin_calls, root, side="left"):
                                 np.searchsorted(begin_calls, end, side="right")]
            if not ((inside >= step_start) & (inside <= step_end)).any():
                break
            first = root
        if first == step_start:
            continue
        # an inference step that held only such calls (and its input wait) goes too
        for other in earlier[::-1].tolist():
            if names[other] != INFERENCE_STEP_NAME or ends[other] < first:
                break
            inside = root_starts[(root_starts >= starts[other]) & (root_starts <= ends[other])]
            if not len(inside) or inside.min() < first:
                break
            keep[other] = False
            first = int(starts[other])
        new_starts[step] = first
    return new_starts, keep


def mark_rows(window: Window) -> pd.DataFrame:
    """The model-level records of every thread (user spans, steps, optimizer steps, backward
    passes and compilations) and its input waits (input level)."""
    frames = []
    begins = _backward_begins(window)
    for buffer in window.buffers:
        cols = buffer.mark_columns
        if not len(cols):
            continue
        errors = [buffer.string(i) for i in as_numpy(cols.error).tolist()]
        # a collective's payload has a typed column
        payloads = [None if a is None else a.get(col.BYTES) for a in cols.attributes]
        mark_kinds = as_numpy(cols.kind)
        mark_starts, joined = _joined_first_calls(buffer, begins)
        keep = ~_nested_backward(mark_kinds, mark_starts, as_numpy(cols.end)) & joined
        kinds = np.array([SPAN_KIND_OF_MARK[k] for k in mark_kinds.tolist()], dtype=object)
        frame = pd.DataFrame({
            col.START_NS: mark_starts,
            col.END_NS: as_numpy(cols.end),
            col.THREAD_ID: buffer.thread_id,
            col.LEVEL: np.where(mark_kinds == MarkKind.INPUT, Level.INPUT.value, Level.MODEL.value).astype(object),
            col.KIND: kinds,
            col.NAME: [buffer.strings.values[i] for i in as_numpy(cols.name).tolist()],
            col.ATTRIBUTES: [_attributes_json(a if a is None or col.BYTES not in a else
                                              {k: v for k, v in a.items() if k != col.BYTES}) for a in cols.attributes],
            col.BYTES: pd.array(payloads, dtype="Int64"),
            col.STATUS: [Status.OK.value if e is None else Status.ERROR.value for e in errors],
            col.STATUS_MESSAGE: errors,
            **site_columns(window.sites, as_numpy(cols.site)),
        })
        frames.append(frame if keep.all() else frame[keep])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
