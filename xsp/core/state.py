"""Process-wide state: the active session's recording.

Kept in a tiny module so that :func:`xsp.span` reads one global on its hot path. The active
session itself is :func:`xsp.session.session.active_session`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xsp.record.recording import Recording

recording: Recording | None = None
