"""Deep capture on demand (``xsp capture PID --steps N -o FILE``): a request that arrives over the
session's control channel (:mod:`xsp.session.control`) has the session's sampler record the next
``N`` steps at every level the session has; their spans are taken from the windows as they are
interpreted, and written to ``FILE`` while the program runs on. The caller hears when the file
is complete, or why it is not."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from xsp.core import schema as col
from xsp.core.control import Op, Reply
from xsp.core.lazy import pandas as pd
from xsp.core.levels import parse_levels
from xsp.io.outputs import check_writable
from xsp.io.parquet import write_trace
from xsp.record.sampling import StepSampler
from xsp.session.children import followed_alive
from xsp.session.control import Caller
from xsp.session.interpreting import WindowInterpreter
from xsp.table.build import concat_spans

ALWAYS_KEPT_LEVELS: Final = frozenset({col.Level.MODEL.value, col.Level.INPUT.value})
MAX_CAPTURE_STEPS: Final = 10_000


class StepCapture:
    """One capture under way: the spans of its steps so far, and where they go."""

    def __init__(self, caller: Caller, output: Path, steps: int, levels: frozenset[str],
                 metadata: dict[str, Any], on_abandon: Callable[[], None], first_step: int = 0) -> None:
        self.caller = caller
        self.first_step = first_step
        """Steps before it were captured for an earlier capture (one its caller gave up on)."""
        self.on_abandon = on_abandon
        self.output = output
        self.wanted = steps
        self.levels = levels
        self.metadata = metadata
        self.steps_taken: list[int] = []
        self.parts: list[pd.DataFrame] = []
        self.done = False
        self._abandoning = threading.Lock()

    def take(self, spans: pd.DataFrame) -> bool:
        """Keep the spans of this window's captured steps; True once all have come (the file is
        then written and the caller told)."""
        if self.done or self.abandoned_if_gone():
            return True
        if col.SAMPLING not in spans:
            return False
        roots = (spans[col.PARENT_ID].isna() & (spans[col.SAMPLING] == col.StepSampling.CAPTURE.value)).fillna(False)
        found = spans[roots.to_numpy(dtype=bool)].sort_values(col.START_NS)
        found = found[(found[col.STEP] >= self.first_step).fillna(False).to_numpy(dtype=bool)]
        steps = [int(step) for step in found[col.STEP].dropna().tolist()][:self.wanted - len(self.steps_taken)]
        if steps:
            mine = spans[col.STEP].isin(steps).fillna(False).to_numpy(dtype=bool)
            mine &= spans[col.LEVEL].astype(str).isin(self.levels | ALWAYS_KEPT_LEVELS).to_numpy(dtype=bool)
            self.parts.append(spans[mine])
            self.steps_taken.extend(steps)
        if len(self.steps_taken) >= self.wanted:
            self._write()
        return self.done

    def abandoned_if_gone(self) -> bool:
        """The caller stopped waiting: no file that nobody asks for any more (True when so, to
        the one caller that dropped it). Asked on the windows' thread and the control thread: the
        sampler's capture is cancelled before the other finds the process free for the next one,
        whose arming it would otherwise cancel."""
        with self._abandoning:
            if self.done or not self.caller.gone():
                return False
            self.done = True
            self.on_abandon()
        return True

    def over(self) -> bool:
        """Nobody waits for this capture any more: its file is written, or it failed, or its
        caller hung up (it is dropped now)."""
        return self.abandoned_if_gone() or self.done

    def _write(self) -> None:
        self.done = True
        spans = concat_spans(self.parts).sort_values(col.START_NS, kind="stable").reset_index(drop=True)
        kept = self.levels | ALWAYS_KEPT_LEVELS
        metadata = {**self.metadata, "levels": [level.value for level in col.Level if level.value in kept],
                    "sampling": None,  # (the session's counts, not this file's: its steps are all captured)
                    "capture": {**self.metadata.get("capture", {}), "steps": self.steps_taken,
                                "written_at_ns": time.time_ns()}}
        try:
            write_trace(self.output, spans, metadata)
        except Exception as exc:
            self.caller.refuse(f"{len(self.steps_taken)} steps were captured but {self.output} could not be "
                               f"written: {exc}")
            return
        self.caller.say(Reply.DONE, output=str(self.output), steps=len(self.steps_taken), spans=len(spans))
        self.caller.end()

    def give_up(self, why: str) -> None:
        """The session ends (or cannot go on) before every step came: no file is written."""
        if not self.done:
            self.done = True
            self.caller.refuse(f"{why} after {len(self.steps_taken)} of {self.wanted} steps; {self.output} "
                               "was not written")


class CaptureDesk:
    """Answers a session's control requests (``status``, ``capture``).

    Args:
        interpreter: the session's, whose windows' spans a capture takes.
        levels: the levels the session records.
        streams: windows are interpreted while the program runs (else no capture can complete).
        sampler: gives the session's step sampler, made on first use (a capture arms it).
        metadata: the session's metadata known now, for the capture's file.
        rank: this process's rank in a distributed job (None: not one).
    """

    def __init__(self, interpreter: WindowInterpreter, levels: tuple[col.Level, ...], streams: bool,
                 sampler: Callable[[], StepSampler], metadata: Callable[[], dict[str, Any]], rank: int | None) -> None:
        self.interpreter = interpreter
        self.levels = levels
        self.streams = streams
        self.sampler = sampler
        self.metadata = metadata
        self.rank = rank
        self.pending: StepCapture | None = None
        self.closing = False
        """The session is ending: requests are refused."""
        self._lock = threading.Lock()

    def handle(self, request: dict[str, Any], caller: Caller) -> None:
        op = request.get("op")
        if self.closing:
            caller.refuse("the session is ending")
            return
        if op == Op.STATUS.value:
            sampler = self.sampler()
            with self._lock:
                capturing = self._under_way()
            caller.say(Reply.STATUS, pid=os.getpid(), steps_begun=sampler.begun, rank=self.rank,
                       levels=[level.value for level in self.levels], capturing=capturing)
            caller.end()
        elif op == Op.CAPTURE.value:
            self._capture(request, caller)
        else:
            caller.refuse(f"unknown request {op!r} (known: {', '.join(op.value for op in Op)})")

    def _capture(self, request: dict[str, Any], caller: Caller) -> None:
        steps, output, first = request.get("steps"), request.get("output"), request.get("from_step")
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_CAPTURE_STEPS:
            caller.refuse(f"steps must be a whole number from 1 to {MAX_CAPTURE_STEPS}, not {steps!r}")
            return
        if not isinstance(output, str) or not os.path.isabs(output):
            caller.refuse("output must be an absolute path")
            return
        if first is not None and (not isinstance(first, int) or isinstance(first, bool) or first < 0):
            caller.refuse(f"from_step must be a step number, not {first!r}")
            return
        if not self.streams:
            caller.refuse("this session interprets its steps only at its end (it writes no file and exports "
                          "nowhere while it runs): start it with an output file or an OTLP endpoint")
            return
        session_levels = {level.value for level in self.levels}
        try:
            asked = {level.value for level in parse_levels(request.get("levels") or sorted(session_levels))}
        except Exception as exc:
            caller.refuse(str(exc))
            return
        missing = sorted(asked - session_levels)
        if missing:
            caller.refuse(f"this process records {', '.join(sorted(session_levels))}; {', '.join(missing)} cannot be "
                          "added while it runs")
            return
        try:
            check_writable(output)
        except Exception as exc:
            caller.refuse(str(exc))
            return
        if self.sampler().begun == 0 and (workers := followed_alive()):  # a server's master: its workers serve
            shown = ", ".join(str(pid) for pid in workers[:8]) + (", ..." if len(workers) > 8 else "")
            caller.refuse("it has begun no step of its own: its model runs in the "
                          f"{len(workers)} child processes it started ({shown}); capture one of those where they run "
                          "always on (xsp run --sample), or start xsp.trace() in each (docs/processes.md)")
            return
        with self._lock:
            if self.closing or self._under_way():
                caller.refuse("the session is ending" if self.closing
                              else "a capture of this process is already under way")
                return
            sampler = self.sampler()
            start = sampler.capture(steps, first)
            if start is None:
                caller.refuse("a capture of this process is already under way")
                return
            metadata = {**self.metadata(), "capture": {"requested_steps": steps, "levels": sorted(asked),
                                                       "from_step": start}}
            capture = StepCapture(caller, Path(output), steps, frozenset(asked), metadata, sampler.cancel_capture,
                                  first_step=start)
            self.pending = capture
            self.interpreter.watch_spans(capture.take, capture.over)
        caller.say(Reply.ACCEPTED, from_step=start, steps=steps)

    def _under_way(self) -> bool:
        """(under the lock) Whether a capture holds the process; one whose caller gave up holds it
        no longer (it is dropped here)."""
        if self.pending is None:
            return False
        self.pending.abandoned_if_gone()
        return not self.pending.done

    def close(self, why: str) -> None:
        """The session ends: a capture still under way gets the reason it is incomplete."""
        with self._lock:
            pending, self.pending = self.pending, None
        if pending is not None and not pending.done:
            sampler = self.sampler()
            sampler.cancel_capture()
            pending.give_up(why)

