"""The ``with xsp.trace():`` block: starting tracers, windows interpreted while the program
runs, stop signals, forked helpers, the overhead calibration and leveled experiments."""
