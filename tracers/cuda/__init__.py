"""The CUDA levels' one CUPTI client, from subscription to span rows.

In the order a session meets them:

* :mod:`~xsp.tracers.cuda.source` -- the process's one CUPTI subscription (:data:`SOURCE`), shared
  by the ``cuda_api`` and ``kernel`` tracers: whether CUPTI can trace here, which libcupti to bind,
  the activity kinds enabled, flushes at step ends, and at the end every kind disabled, a forced
  flush and CUPTI's settings set back as they were found.
* :mod:`~xsp.tracers.cuda.clock` -- CUPTI's timestamps on xsp's host clock: CUPTI handed xsp's
  clock where the C path can, else offsets measured at each drain and interpolated.
* :mod:`~xsp.tracers.cuda.records` -- the activity records as packed columns, read in C
  (``xsp.record._activity``) or through cupti-python, with what was lost counted.
* :mod:`~xsp.tracers.cuda.rows` -- the columns as span rows: API calls, kernels, copies, sets,
  synchronisations, linked by correlation and external ids.

The public faces are :mod:`xsp.tracers.cuda_api` and :mod:`xsp.tracers.kernel`.
"""
