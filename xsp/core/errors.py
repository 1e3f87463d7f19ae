"""Exceptions that xsp raises to its callers."""

from __future__ import annotations


class XspError(Exception):
    """Base class of every error xsp raises on purpose."""


class UnknownLevelError(XspError, ValueError):
    """A level name that is not one of model, layer, operator, cuda_api, kernel."""


class TraceFormatError(XspError):
    """A file that is not a readable xsp trace (wrong format, truncated, corrupt)."""


class SchemaVersionError(TraceFormatError):
    """A trace written by a newer xsp whose span table this version cannot read."""


class TraceNotFoundError(XspError, FileNotFoundError):
    """No trace file at the given path."""


class XspWarning(UserWarning):
    """Something xsp could not do; the user's program carries on regardless."""
