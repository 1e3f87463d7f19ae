"""A call wrapped by two hooks, with no Python frame of its own (xsp/session/_around.c): what
:func:`xsp.session.children.around` uses where the extension is built."""

from collections.abc import Callable
from typing import Any

class Around:
    """``function(x)`` between ``before(x) -> token`` and ``after(x, token, failed)``; errors of
    the hooks are dropped; bound as a method when set on a class."""

    function: Callable[[Any], Any]
    def __init__(self, before: Callable[[Any], Any], function: Callable[[Any], Any],
                 after: Callable[[Any, Any, bool], Any]) -> None: ...
    def __call__(self, argument: Any, /) -> Any: ...
    def __get__(self, instance: Any, owner: type | None = None) -> Any: ...
