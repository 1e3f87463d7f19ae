"""``python -m xsp`` runs the CLI, through the same entry point as the ``xsp`` command."""

from xsp.cli.entry import entry_point

entry_point()
