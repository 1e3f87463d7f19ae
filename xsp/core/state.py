"""Process-wide state: the one active session and its recording.

Kept in a tiny module so that :func:`xsp.span` reads one global on its hot path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xsp.record.recording import Recording
    from xsp.session.session import Session

session: Session | None = None
recording: Recording | None = None
waiting: list[Session] = []
"""Blocks that joined the active session and are still inside: the first of them takes its
recording over, without a gap, when the active one ends (docs/steps.md)."""
