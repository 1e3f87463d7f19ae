"""The example service (examples/service/serve.py) with one part of xsp's cost taken out, for
``benchmarks/production.py --split``. ``XSP_BENCH_SPLIT`` says which:

* ``no_steps``: the server runs inside ``xsp.trace(...)`` as ``serve.py`` does, but xsp's module-call
  wrapper is taken out of ``nn.Module.__call__`` as soon as the session has started (and put back
  before it ends): the session's threads, imports and objects are there, yet no step is ever
  recorded, so no window ever closes;
* ``timer``: no xsp at all; ``nn.Module.__call__`` is replaced by a C object that reads the clock
  around each top-level module call and keeps the readings in memory (``benchmarks/timer_floor.c``,
  built here with the machine's C compiler): what timing every request's model call costs by
  itself, the floor of any model-level tracer;
* ``switch``: the server runs inside ``xsp.trace(...)`` as ``serve.py`` does, and ``POST
  /xsp_steps?on=false`` takes xsp's module-call wrapper out (no step recorded), ``?on=true`` puts it
  back: ``benchmarks/steps_in_process.py`` loads one process with its steps on and off in turn, so
  that the steps' cost is measured free of how two processes differ (their memory layouts);
* ``presence``: the server starts with no xsp session; ``POST /xsp_session?on=true`` starts one
  (``xsp.trace(...)`` as ``serve.py`` would, its module-call wrapper taken out at once: no step is
  ever recorded) and ``?on=false`` ends it: ``benchmarks/steps_in_process.py --presence`` loads one
  process with a live session and without one in turn, so that what a session's mere presence
  costs (its threads, signal handlers and objects) is measured free of how two processes differ;
* ``whole``: as ``presence``, but the session started on request is the whole of it, as ``serve.py``
  runs (its wrapper in place: every request a step, the fraction drawn recorded with its layers,
  windows closing as they are due); ending it writes its trace file, before the request answers:
  ``benchmarks/steps_in_process.py --whole`` measures everything xsp costs inside one process.

Usage: XSP_BENCH_SPLIT=no_steps|switch|presence|whole XSP_BENCH_MODE=xsp python benchmarks/split_server.py PORT
       XSP_BENCH_SPLIT=timer python benchmarks/split_server.py PORT
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from torch import nn

SPLIT_ENV = "XSP_BENCH_SPLIT"
NO_STEPS, TIMER, SWITCH, PRESENCE, WHOLE = "no_steps", "timer", "switch", "presence", "whole"
STEPS_PATH = "/xsp_steps"
"""``switch``: POST here with ``on=true`` or ``on=false``."""
SESSION_PATH = "/xsp_session"
"""``presence`` and ``whole``: POST here with ``on=true`` (a session starts: with no steps, or the whole
of it) or ``on=false`` (it ends)."""
SERVICE = Path(__file__).resolve().parents[1] / "examples" / "service"
TIMER_SOURCE = Path(__file__).resolve().parent / "timer_floor.c"

sys.path.insert(0, str(SERVICE))
import serve  # noqa: E402  (the example service, found beside it)


class StepSwitch:
    """xsp's module-call wrapper, put in ``nn.Module.__call__`` or taken out on request."""

    def __init__(self) -> None:
        self.wrapper: Any = None

    @contextmanager
    def session(self, options: dict[str, Any], steps: bool = True) -> Iterator[Any]:
        """``xsp.trace(**options)``, its wrapper kept here (in place, or taken out at once where not
        ``steps``), and put back before the session ends (xsp takes its own out), whatever was asked."""
        import xsp

        with xsp.trace(**options) as session:
            wrapper = nn.Module.__dict__["__call__"]
            if getattr(wrapper, "original", None) is None:
                raise SystemExit("xsp's C wrapper is not built here: nothing to take out")
            self.wrapper = wrapper
            self.steps(steps)
            try:
                yield session
            finally:
                nn.Module.__call__ = wrapper  # type: ignore[method-assign]

    def steps(self, on: bool) -> None:
        """Put the wrapper in (every module call recorded as xsp records it) or take it out."""
        if self.wrapper is None:
            raise RuntimeError("the session has not started")
        nn.Module.__call__ = self.wrapper if on else self.wrapper.original  # type: ignore[method-assign]

    def app(self, model: nn.Module, provider: Any, health: dict[str, Any]) -> Any:
        """The example service's app with ``POST /xsp_steps?on=...`` added."""
        app = BUILD_APP(model, provider, health)

        @app.post(STEPS_PATH)
        async def steps(on: bool) -> dict[str, bool]:  # on the event loop: between requests, not beside one
            self.steps(on)
            return {"on": on}

        return app


class SessionSwitch:
    """An xsp session, with no steps (or, ``whole``, the whole of it), started and ended on
    request, in a server that has none at first."""

    def __init__(self, whole: bool = False) -> None:
        self.options: dict[str, Any] = {}
        self.live: ExitStack | None = None
        self.whole = whole

    def no_session(self, options: dict[str, Any]) -> AbstractContextManager[Any]:
        """What ``serve.py`` would run the server inside: nothing, its options kept for later."""
        self.options = options
        return nullcontext()

    def session(self, on: bool) -> None:
        """Start a session (``on``), or end the live one."""
        if on and self.live is None:
            live = ExitStack()
            live.enter_context(BUILD_SESSION(self.options) if self.whole else session_without_steps(self.options))
            self.live = live
        elif not on and self.live is not None:
            live, self.live = self.live, None
            live.close()

    def app(self, model: nn.Module, provider: Any, health: dict[str, Any]) -> Any:
        """The example service's app with ``POST /xsp_session?on=...`` added."""
        app = BUILD_APP(model, provider, health)

        @app.post(SESSION_PATH)
        async def session(on: bool) -> dict[str, bool]:  # on the event loop (the main thread), between requests
            self.session(on)
            return {"on": on}

        return app


def session_without_steps(options: dict[str, Any]) -> AbstractContextManager[Any]:
    """``xsp.trace(**options)`` with its module-call wrapper taken out while the block runs."""
    return StepSwitch().session(options, steps=False)


BUILD_APP = serve.build_app
BUILD_SESSION = serve.xsp_session


def install_timer() -> None:
    """Build timer_floor.c and put its Timer in ``nn.Module.__call__``."""
    folder = Path(tempfile.mkdtemp(prefix="xsp-timer-floor-"))
    built = folder / f"timer_floor{sysconfig.get_config_var('EXT_SUFFIX')}"
    compiler = os.environ.get("CC", "cc")
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(TIMER_SOURCE),
                    "-o", str(built)], check=True)
    spec = importlib.util.spec_from_file_location("timer_floor", built)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shutil.rmtree(folder)  # loaded: the process keeps its mapping
    nn.Module.__call__ = module.Timer(nn.Module.__call__)  # type: ignore[method-assign]


def main() -> int:
    split = os.environ.get(SPLIT_ENV)
    if split == NO_STEPS:
        serve.xsp_session = session_without_steps  # type: ignore[assignment]
    elif split == TIMER:
        install_timer()
    elif split == SWITCH:
        switch = StepSwitch()
        serve.xsp_session = switch.session  # type: ignore[assignment]
        serve.build_app = switch.app  # type: ignore[assignment]
    elif split in (PRESENCE, WHOLE):
        sessions = SessionSwitch(whole=split == WHOLE)
        serve.xsp_session = sessions.no_session  # type: ignore[assignment]
        serve.build_app = sessions.app  # type: ignore[assignment]
        try:
            return serve.main()
        finally:
            sessions.session(False)
    else:
        raise SystemExit(f"{SPLIT_ENV} must be {NO_STEPS}, {TIMER}, {SWITCH}, {PRESENCE} or {WHOLE}, not {split!r}")
    return serve.main()


if __name__ == "__main__":
    sys.exit(main())
