"""The ``xsp`` command's entry point, apart from the CLI so that it loads in no time: the CLI's
modules take tens of milliseconds to import, and a Ctrl-C meanwhile ends the command as one
line, as it does once the command runs, not as a traceback."""

from __future__ import annotations

import sys

from xsp.core.errors import INTERRUPTED


def entry_point() -> None:
    """Load the CLI and run the command (:func:`xsp.cli.main.entry_point`)."""
    try:
        from xsp.cli.main import entry_point as run
    except KeyboardInterrupt:
        sys.stderr.write("xsp: interrupted\n")
        sys.exit(INTERRUPTED)
    run()
