"""Intercepting ``nn.Module`` calls: the mechanism behind the model and layer levels.

In the order a call meets it:

* :mod:`~xsp.tracers.module_calls.interceptor` -- xsp puts its wrapper (in C where built) in
  ``torch.nn.Module.__call__`` while a session records, and takes it out after; each call
  appends one record to its thread's buffer, and pushes a CUPTI external id when the CUDA
  levels run.
* :mod:`~xsp.tracers.module_calls.call_context` -- what the wrapper consults about a call: how
  much to record (:class:`Mode`), the correlation hooks, and the entry points of the jit tracer
  and dynamo.
* :mod:`~xsp.tracers.module_calls.jit_dynamo` -- stepping aside while ``torch.jit`` traces or
  dynamo compiles.
* :mod:`~xsp.tracers.module_calls.native_torch` -- torch's C++ functions the C wrapper calls
  directly (the grad mode).
* :mod:`~xsp.tracers.module_calls.model_names` -- top-level models named as the calling code
  binds them (``encoder``, ``head``).
* :mod:`~xsp.tracers.module_calls.call_values` -- a call's inputs and outputs described as the
  span table keeps them (shapes, errors, recomputation).
* :mod:`~xsp.tracers.module_calls.rows` -- after the session, the recorded calls interpreted as
  span rows: names, module facts, shapes.
* :mod:`~xsp.tracers.module_calls.lifecycle` -- the start and stop the model and layer tracers
  share.

The public faces are :mod:`xsp.tracers.model` and :mod:`xsp.tracers.layer`.
"""
