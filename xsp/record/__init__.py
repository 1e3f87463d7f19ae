"""Recording on the hot path: per-thread buffers, the step rule, marks, samples, user spans,
schedules, and the C fast path of the module-call wrapper (``_hotpath``) and of CUPTI's
activity records (``_activity``). Records are kept raw here; they are interpreted later."""
