"""Stopping signals that land on another thread, sent on to the main one
(xsp/session/_signals.c): what :mod:`xsp.session.signals` uses where the extension is built."""

def send_to_main_thread(signum: int, /) -> bool:
    """Called on the main thread once ``signal.signal`` gave ``signum`` a Python handler: the
    signal, where it lands on another thread, is sent on to this one. False where there is
    nothing to send on (no Python handler, or the signal blocked on this thread)."""
