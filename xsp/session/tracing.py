"""``xsp.trace()``: the public way to profile a block of code, a :class:`xsp.session.session.Session`
made from its arguments."""

from __future__ import annotations

import os

from xsp.core.levels import LevelsArg
from xsp.core.schema import DEFAULT_OUTPUT
from xsp.record.columns import DEFAULT_MAX_EVENTS
from xsp.record.schedule import Schedule
from xsp.session.options import DEFAULT_LEVELS, DEFAULT_LONG_STEP_S
from xsp.session.session import Session


def trace(levels: LevelsArg = DEFAULT_LEVELS, output: str | os.PathLike[str] | None = DEFAULT_OUTPUT,
          otlp_endpoint: str | None = None, service_name: str | None = None,
          otlp_protocol: str | None = None, max_events: int = DEFAULT_MAX_EVENTS,
          long_step_s: float = DEFAULT_LONG_STEP_S,
          schedule: Schedule | str | dict[str, int] | None = None, calibrate: bool = False,
          span_budget: int | None = None, dataset: str | os.PathLike[str] | None = None,
          backward: bool = True, layer_depth: int | None = None, nvtx: bool | None = None,
          sample: float | None = None, slow_factor: float | None = None,
          rotate: str | float | None = None, window_s: float | None = None) -> Session:
    """Profile the code in a ``with`` block (or each call of a decorated function).

    Args:
        levels: levels to record, as ``("model", "layer")`` or ``"model,layer"``. The model
            level is always recorded. Levels no tracer can record here are warned about once.
        output: the ``.xsp.parquet`` file to write after the block; None to write none.
        otlp_endpoint: OTLP collector URL (``http://localhost:4317``); default from
            ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``, else none.
        service_name: OTel ``service.name``; default ``OTEL_SERVICE_NAME``, else the script name.
        otlp_protocol: ``grpc`` or ``http/protobuf``; default ``OTEL_EXPORTER_OTLP_PROTOCOL``, else grpc.
        max_events: records kept before further ones are dropped (and counted).
        long_step_s: when exporting to OTLP, a step that lasts at least this long is exported
            as soon as it ends (once its thread is outside every module call and step),
            instead of after the block.
        schedule: record only some steps, as torch.profiler's schedule: an
            :class:`xsp.Schedule`, a dict of its fields, or ``"skip_first=10,wait=1,warmup=1,active=3,repeat=2"``.
            Steps are counted from the block's start; steps not recorded cost almost nothing.
        calibrate: before the block, measure what one span of each host level costs here
            (about a second; :mod:`xsp.session.calibration`) and keep it in ``metadata["calibration"]``,
            so that :func:`xsp.analysis.compensated` can take xsp's own cost out of the figures.
        span_budget: when exporting to OTLP, the most spans one trace (a step) is sent with;
            a step over it has its deepest levels folded into aggregate spans, so that Jaeger
            can open it (the file keeps every span). Default ``XSP_SPAN_BUDGET``, else
            :data:`xsp.export.target.DEFAULT_SPAN_BUDGET` (2000); 0: no limit.
        dataset: instead of ``output``, write the trace into this folder of runs, as
            ``<dataset>/run=<run id>/rank=<rank>/<service>.xsp.parquet``: every run's traces then
            form one Parquet dataset that DuckDB, Spark or Trino query with ``run`` and ``rank``
            as partition columns. The run id is ``XSP_RUN_ID``, else the distributed job's id,
            else the start time with a random suffix.
        backward: while autograd records a graph, hook each layer call's graph node so that
            its backward becomes a span (several microseconds per layer call). False for a
            block that never runs backward, such as inference without ``torch.no_grad``: its
            layers then cost what they cost under ``no_grad``.
        layer_depth: record layers down to this module call depth only (1: the calls the
            model makes itself, 2: theirs, ...); deeper calls run through unrecorded. None
            records every depth. :func:`xsp.leveled` runs one depth at a time.
        sample: always on, for services and long jobs (``docs/production.md``): every step is
            timed at the model level, and this fraction of steps (0 to 1) is recorded at every
            level asked for; so are the steps after a slow one and those ``xsp capture`` asks
            for. A step that begins inside an OpenTelemetry span (a request's server span) joins
            that span's trace; a request the application's sampler dropped is recorded at the
            model level only and not exported. Default ``XSP_SAMPLE``, else every step at every
            level.
        slow_factor: with ``sample`` (or ``XSP_SAMPLE``), a step slower than this many times the
            running median step is slow: the next steps are recorded deep (0: no such rule;
            default 5). Without sampling it is refused (ValueError).
        rotate: with ``dataset``, for a program that runs for days: write the trace as parts,
            ``<dataset>/run=<id>/rank=<rank>/part-<k>.xsp.parquet``, each sealed (and readable)
            after this long or this large: ``"1h"``, ``"500MB"``, ``"1h,500MB"``, or seconds (parts are
            sealed as windows close: windows then close at least as often as parts are due).
            :func:`xsp.load` of the folder reads the parts as one trace.
        window_s: how often, in seconds, what was recorded is interpreted and written (and
            exported) while the program runs: a window closes at the first step end this long
            after the last. Default 1 s, and 60 s with ``sample`` (or ``XSP_WINDOW_S`` there).
            Each window of an always-on session costs a few tenths of a second of CPU whatever
            it holds: longer windows cost less, and a request's spans reach the collector later.

    Raises:
        xsp.UnknownLevelError: a level name that does not exist.
        xsp.ScheduleError: a schedule that cannot be followed.

    Example:
        >>> import torch, xsp
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> with xsp.trace(levels="model,layer", output=None) as session:
        ...     _ = model(torch.randn(2, 4))
        >>> session.trace.spans["name"].tolist()[:3]
        ['session', 'model', 'model.0']
    """
    return Session(levels=levels, output=output, otlp_endpoint=otlp_endpoint, service_name=service_name,
                   otlp_protocol=otlp_protocol, max_events=max_events, long_step_s=long_step_s, schedule=schedule,
                   calibrate=calibrate, span_budget=span_budget, dataset=dataset, backward=backward,
                   layer_depth=layer_depth, nvtx=nvtx, sample=sample, slow_factor=slow_factor, rotate=rotate,
                   window_s=window_s)
