"""Stopping signals that land on another thread, sent on to the main one
(xsp/session/_signals.c): what :mod:`xsp.session.signals` uses where the extension is built."""

def send_to_main_thread(signum: int, /) -> bool:
    """Called on the main thread once ``signal.signal`` gave ``signum`` a Python handler: the
    signal, where it lands on another thread, is sent on to this one. False where there is
    nothing to send on (no Python handler, or the signal blocked on this thread)."""

def handled() -> None:
    """Called by the Python handler of the signals sent on: it ran, so the main thread needs no
    more waking for the stopping signals that came so far (a signal CPython noted while the main
    thread ran another handler is otherwise woken for every 0.1 s until it runs)."""

def give_up_after(signum: int, message: bytes | None, /) -> None:
    """``signum``'s action was the default: where its Python handler has not run 5 s after it
    came (the main thread waits in native code that retries when interrupted), the process ends
    by it with the default action, as it would have without xsp, after ``message`` is written to
    stderr. ``message`` None: no longer."""
