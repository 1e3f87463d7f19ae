"""The span schema and what every layer shares: errors, clocks, levels, run metadata, ranks.

Nothing here imports from another xsp package."""
