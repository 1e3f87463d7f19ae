"""CI verdicts: comparing two runs (or folders of runs) key by key with rank tests, baselines
and their compact summaries."""
