"""``python -m xsp`` runs the CLI."""

from xsp.cli.main import entry_point

entry_point()
