"""The ``xsp`` command line."""
