"""The canonical span table: levels, kinds, column names and dtypes, attribute keys.

Every source of spans (live tracers, imported traces) produces a pandas DataFrame with
exactly these columns and dtypes; every consumer (file writer, OTLP exporter, analyses,
reports) reads them through the constants below, never through string literals.

Times are integer nanoseconds since the Unix epoch (the clock OpenTelemetry expects);
``duration_ns == end_ns - start_ns``.

``path`` is a structural key that names "the same span" across steps and runs. It is the
path of the span's anchor, a ``/`` and ``name[k]``, where ``k`` counts earlier spans of the
same name under the same anchor. The anchor is the parent, except that a layer skips over
enclosing layers (a layer's name is already its dotted module path) and an operator over
enclosing operators, so a ResNet convolution is ``predict[0]/layer1.0.conv1[0]`` rather than
repeating ``layer1`` and ``layer1.0``, and ``aten::addmm`` inside ``aten::linear`` in that
layer is ``.../fc[0]/aten::addmm[0]``. Roots are ``name[k]`` counted within their OTel trace
(their step).
"""

from __future__ import annotations

import enum
import json
from typing import Final

SCHEMA_VERSION: Final = 1
"""Version of the span table layout; bumped on any incompatible change."""

FILE_SUFFIX: Final = ".xsp.parquet"
KINETO_SUFFIXES: Final = (".json", ".json.gz")
"""Names of the Kineto (PyTorch profiler) traces xsp reads."""
NSYS_SUFFIXES: Final = (".sqlite", ".sqlite3", ".db")
"""Names that say a file is meant as an SQLite export (Nsight Systems), whatever its bytes."""
FOREIGN_SUFFIXES: Final = (*KINETO_SUFFIXES, *NSYS_SUFFIXES)
"""Names of the traces other tools write, which xsp reads as those tools' formats."""
DEFAULT_OUTPUT: Final = "run" + FILE_SUFFIX
"""The trace file a session writes when it is given none."""
METADATA_KEY: Final = b"xsp"
"""Parquet key-value metadata key that holds the trace's metadata as JSON."""
SUMMARY_METADATA_KEY: Final = b"xsp.summary"
"""The Parquet footer key of an xsp summary (``xsp summary``, what ``xsp diff`` reads as a baseline)."""


class Level(str, enum.Enum):
    """Depth of the stack a span was recorded at, shallowest first."""

    MODEL = "model"
    INPUT = "input"
    """The loop waiting for its data (DataLoader batches); always recorded with the model level,
    since a wait for a batch is where an automatic step begins."""
    LAYER = "layer"
    OPERATOR = "operator"
    MEMORY = "memory"
    """Each allocation and free of tensor memory (``alloc``/``free`` events, CPU and CUDA),
    from PyTorch's profiler; perturbs timings."""
    FLOPS = "flops"
    """Analytic FLOPs and bytes per operator (``operator`` spans); perturbs timings."""
    CUDA_API = "cuda_api"
    KERNEL = "kernel"
    GPU_METRICS = "gpu_metrics"
    """Hardware counters sampled on the GPU (``counters`` spans); perturbs timings."""
    SYSTEM = "system"
    """CPU, memory, GPU utilisation, power and energy sampled a few times a second
    (``sample`` spans, see :mod:`xsp.record.samples`)."""

    @property
    def rank(self) -> int:
        """0 for the model level, growing with depth."""
        return _LEVEL_ORDER.index(self)


_LEVEL_ORDER: Final = (Level.MODEL, Level.INPUT, Level.LAYER, Level.OPERATOR, Level.MEMORY, Level.FLOPS,
                       Level.CUDA_API, Level.KERNEL, Level.GPU_METRICS, Level.SYSTEM)
METRIC_LEVELS: Final = frozenset({Level.FLOPS, Level.GPU_METRICS, Level.MEMORY})
"""Levels that measure counts, not time: their runs perturb timings, so leveled
experimentation never takes durations from them."""
LEVELS: Final = _LEVEL_ORDER


class SpanKind(str, enum.Enum):
    """What a span stands for, finer than its level."""

    SESSION = "session"  # the whole xsp.trace() block (model level, its own OTel trace)
    STEP = "step"  # an explicit xsp.step() (model level)
    PREDICT = "predict"  # one call of a top-level nn.Module (model level)
    USER = "user"  # xsp.span() (model level)
    INPUT = "input"  # the loop waiting for a DataLoader batch (input level)
    OPTIMIZER = "optimizer"  # one optimizer.step() (model level)
    COMPILE = "compile"  # torch.compile compiling a frame (model level); not model latency
    COLLECTIVE = "collective"  # one torch.distributed collective called from Python (model level)
    COLLECTIVE_WAIT = "collective_wait"  # waiting for an async collective's Work (model level)
    FORWARD = "forward"  # one nn.Module forward call (layer level)
    BACKWARD = "backward"  # one nn.Module backward (layer level); one backward pass (model level)
    RECOMPUTE = "recompute"  # a module's forward run again inside a backward (activation checkpointing; layer level)
    PYTHON = "python"  # a Python function seen by PyTorch's profiler (layer level)
    OPERATOR = "operator"  # one framework operator (operator level)
    RUNTIME = "runtime"  # CUDA runtime API call (cuda_api level)
    DRIVER = "driver"  # CUDA driver API call (cuda_api level)
    KERNEL = "kernel"  # GPU kernel (kernel level)
    MEMCPY = "memcpy"  # GPU memory copy (kernel level)
    MEMSET = "memset"  # GPU memory set (kernel level)
    SYNC = "sync"  # GPU synchronisation (kernel level)
    ALLOC = "alloc"  # tensor memory allocated: an instant, ``bytes`` its size (memory level)
    FREE = "free"  # tensor memory freed: an instant, ``bytes`` its size (memory level)
    SAMPLE = "sample"  # one interval of system metrics (system level)
    GC = "gc"  # one garbage collection by CPython's collector, on the thread that ran it (system level);
    # every Python thread waits for it (it holds the GIL)
    PROCESS = "process"  # a child process the session followed, from its start to its end (model level)
    FETCH = "fetch"  # a DataLoader worker fetching and collating one batch, in its process (input level)
    COUNTERS = "counters"  # a range measured with hardware counters (kernel level; replayed, so
    # its duration is not the kernel's)
    GRAPH_NODE = "graph_node"  # a CUDA graph node made while a graph was captured, or cloned when it
    # was instantiated: an instant on the thread that made it (kernel level), under the layer and
    # operator that made it


CLOSURE_SUFFIX: Final = ".closure"
"""The end of the name of the ``user`` span of a closure an optimizer step ran
(``optimizer.step(closure)``: LBFGS, PyTorch Lightning): ``SGD.step.closure``. The program's own
code, inside the optimizer span: ``other`` in a step's breakdown, not ``optimizer``."""


STEP_KINDS: Final = frozenset({SpanKind.STEP, SpanKind.PREDICT})
"""Kinds whose outermost occurrence starts a step."""
GPU_ACTIVITY_KINDS: Final = frozenset({SpanKind.KERNEL, SpanKind.MEMCPY, SpanKind.MEMSET, SpanKind.SYNC})
"""Kernel-level kinds that a CUDA API call launches (linked by correlation id)."""


class StepSampling(str, enum.Enum):
    """Why a step of an always-on session (``xsp.trace(sample=...)``) was or was not recorded
    below the model level (the ``sampling`` column of its root)."""

    MODEL_ONLY = "model_only"
    """Not drawn: timed at the model level only."""
    SAMPLED = "sampled"
    """Drawn (a fraction ``sample`` of steps): recorded at every level asked for."""
    AFTER_SLOW = "after_slow"
    """Recorded deep because a step before it was slow."""
    CAPTURE = "capture"
    """Recorded deep because ``xsp capture`` asked for it."""
    REQUEST_NOT_SAMPLED = "request_not_sampled"
    """Inside a request the application's OpenTelemetry sampler dropped: model level only, and
    not exported."""


class BackwardEnd(str, enum.Enum):
    """Where a backward layer span's end was taken from, where it is not the end of the module's
    own last graph node (its ``xsp.backward_end`` attribute)."""

    SUBMODULES = "submodules"
    """Stretched over its submodules' backward spans."""
    NEXT_BACKWARD = "next_backward"
    """A leaf module whose own part of the graph is too large to search at each call (an
    ``nn.GRU`` on CPU, hundreds of nodes): it ends where the next layer's backward begins on its
    thread, within its backward pass."""


class Status(str, enum.Enum):
    """Outcome of a span: ERROR when an exception passed through it."""

    OK = "ok"
    ERROR = "error"


# Column names ---------------------------------------------------------------------------
TRACE_ID: Final = "trace_id"
SPAN_ID: Final = "span_id"
PARENT_ID: Final = "parent_id"
LEVEL: Final = "level"
KIND: Final = "kind"
NAME: Final = "name"
START_NS: Final = "start_ns"
END_NS: Final = "end_ns"
DURATION_NS: Final = "duration_ns"
THREAD_ID: Final = "thread_id"
DEVICE_ID: Final = "device_id"
STREAM_ID: Final = "stream_id"
CORRELATION_ID: Final = "correlation_id"
STEP: Final = "step"
PATH: Final = "path"
STATUS: Final = "status"
STATUS_MESSAGE: Final = "status_message"
# typed attributes read by analyses
MODULE_TYPE: Final = "module_type"
INPUT_SHAPES: Final = "input_shapes"
OUTPUT_SHAPES: Final = "output_shapes"
PARAM_COUNT: Final = "param_count"
CALL_DEPTH: Final = "call_depth"
EXEC_INDEX: Final = "exec_index"
SOURCE: Final = "source"
CALL_FILE: Final = "call_file"
"""On ``predict``, layer ``forward`` and ``user`` spans (and explicit steps): the file of the line
in the user's code that made the call (the first frame outside PyTorch, xsp, the standard
library and installed packages; :mod:`xsp.record.sites` has the rule). Null when no user frame
made it."""
CALL_LINE: Final = "call_line"
"""The line number of that call, in ``call_file``."""
CALL_FUNCTION: Final = "call_function"
"""The function that made the call (its qualified name: ``Net.forward``, ``<module>``)."""
BATCH_SIZE: Final = "batch_size"
GRID: Final = "grid"
BLOCK: Final = "block"
REGISTERS_PER_THREAD: Final = "registers_per_thread"
SHARED_MEMORY_BYTES: Final = "shared_memory_bytes"
BYTES: Final = "bytes"
COPY_KIND: Final = "copy_kind"
FLOPS: Final = "flops"
SEQUENCE_NUMBER: Final = "sequence_number"
"""Autograd sequence number of an operator: a backward operator carries its forward's."""
EXTERNAL_ID: Final = "external_id"
"""CUPTI external correlation id. On a layer span recorded with the CUDA levels on, the id xsp
pushed around the call (its start on the host clock); on a CUDA API call, the id on top of
CUPTI's stack when the call was made, which names the layer span that made it."""
LEVELED_RUN: Final = "leveled_run"
"""In a leveled result: the run (``model+layer``) the span's duration came from."""
DURATION_CI_NS: Final = "duration_ci_ns"
"""In a leveled result: the half-width of the 95% confidence interval of ``duration_ns``."""
RANK: Final = "rank"
"""In a distributed job: the rank of the process that recorded the span (null otherwise)."""
PROCESS_ID: Final = "process_id"
"""On the spans of a child process the session followed (``multiprocessing``: a ``Process``, a
``Pool``'s workers, a DataLoader's workers): that process's id. Null on the session's own
process's spans (the metadata's ``process_id``)."""
OVERHEAD_NS: Final = "overhead_ns"
"""In a leveled result: xsp's own calibrated cost, taken out of ``duration_ns`` (the raw figure
is their sum); negative for a layer whose untimed call cost was given back to it."""
SAMPLING: Final = "sampling"
"""On the root of each step of an always-on session: why it was or was not recorded below the
model level (:class:`StepSampling`). Null elsewhere."""
GRAPH_NODE_ID: Final = "graph_node_id"
"""CUPTI's id of a CUDA graph node: on a kernel, copy or set that a graph launch ran (a replay),
the node that ran it; on a ``graph_node`` span, the node made or cloned. Null elsewhere."""
REMOTE_PARENT_ID: Final = "remote_parent_id"
"""On the root of a step that began inside an OpenTelemetry span of the application (a request's
server span): that span's id. The step's spans carry that span's trace id, and the root is exported
as its child; in the file the root's ``parent_id`` stays null (the parent is not xsp's)."""
ATTRIBUTES: Final = "attributes"
"""JSON object with every attribute that has no typed column (user attributes among them)."""

PROFILER_STEP_NAME: Final = "ProfilerStep#"
"""How PyTorch's profiler names its steps: ``ProfilerStep#N`` is step ``N``."""

BACKWARD_SUFFIX: Final = ".backward"
"""What a layer's backward span adds to its module's name (``model.fc`` -> ``model.fc.backward``)."""

CATEGORY: Final = "category"
"""The dtype of the text columns whose values repeat across rows (trace ids, levels, kinds,
names, paths, statuses, input shapes, kernel grids and blocks): pandas categoricals, each distinct text
stored once. A 2M-event trace holds a few thousand names; as strings they took 50-100 bytes a
row, as categories 1-4."""

# pandas dtypes, in column order. Nullable integer dtypes keep "not recorded" apart from 0.
COLUMNS: Final[dict[str, str]] = {
    TRACE_ID: CATEGORY,
    SPAN_ID: "int64",
    PARENT_ID: "Int64",
    LEVEL: CATEGORY,
    KIND: CATEGORY,
    NAME: CATEGORY,
    START_NS: "int64",
    END_NS: "int64",
    DURATION_NS: "int64",
    THREAD_ID: "Int64",
    DEVICE_ID: "Int64",
    STREAM_ID: "Int64",
    CORRELATION_ID: "Int64",
    STEP: "Int64",
    PATH: CATEGORY,
    STATUS: CATEGORY,
    STATUS_MESSAGE: "string",
    MODULE_TYPE: "string",
    INPUT_SHAPES: CATEGORY,
    OUTPUT_SHAPES: "string",
    PARAM_COUNT: "Int64",
    CALL_DEPTH: "Int64",
    EXEC_INDEX: "Int64",
    SOURCE: "string",
    CALL_FILE: "string",
    CALL_LINE: "Int64",
    CALL_FUNCTION: "string",
    BATCH_SIZE: "Int64",
    GRID: CATEGORY,
    BLOCK: CATEGORY,
    REGISTERS_PER_THREAD: "Int64",
    SHARED_MEMORY_BYTES: "Int64",
    BYTES: "Int64",
    COPY_KIND: "string",
    FLOPS: "Int64",
    SEQUENCE_NUMBER: "Int64",
    EXTERNAL_ID: "Int64",
    LEVELED_RUN: "string",
    DURATION_CI_NS: "Int64",
    OVERHEAD_NS: "Int64",
    RANK: "Int64",
    PROCESS_ID: "Int64",
    SAMPLING: CATEGORY,
    REMOTE_PARENT_ID: "Int64",
    GRAPH_NODE_ID: "Int64",
    ATTRIBUTES: "string",
}
REQUIRED_COLUMNS: Final = (
    TRACE_ID, SPAN_ID, PARENT_ID, LEVEL, KIND, NAME, START_NS, END_NS, DURATION_NS,
    THREAD_ID, DEVICE_ID, STREAM_ID, CORRELATION_ID, STEP, PATH,
)

# OpenTelemetry attribute keys (all xsp-owned keys carry the xsp. prefix; the call site's are
# OpenTelemetry's own code.* keys) --------------------------------------------------------
ATTR_LEVEL: Final = "xsp.level"
ATTR_KIND: Final = "xsp.kind"
ATTR_STEP: Final = "xsp.step"
ATTR_PATH: Final = "xsp.path"
ATTR_THREAD_ID: Final = "xsp.thread_id"
ATTR_DEVICE_ID: Final = "xsp.device_id"
ATTR_STREAM_ID: Final = "xsp.stream_id"
ATTR_CORRELATION_ID: Final = "xsp.correlation_id"
ATTR_SESSION_LINK: Final = "xsp.link"
ATTR_SESSION_METADATA: Final = "xsp.session.metadata"
"""On the session span sent to a collector: the trace's metadata as JSON (``xsp pull`` reads it back)."""
ATTR_SESSION_SENT: Final = "xsp.session.sent"
"""On the session span sent to a collector: what the session sent in all, as JSON (``traces``, the
session's own and one per step; ``spans``): ``xsp pull`` checks what came back against it."""
ATTR_VERSION: Final = "xsp.version"
ATTR_TORCH_VERSION: Final = "xsp.torch.version"
ATTR_DEVICE: Final = "xsp.device"
ATTR_STEP_TYPE: Final = "xsp.step.type"
"""On an automatic step: ``train``, ``inference`` or ``generate``."""
ATTR_MODEL_TRAINING: Final = "xsp.model.training"
"""On a top-level model call: the module was in training mode (``model.train()``)."""
ATTR_MODEL_GRAD: Final = "xsp.model.grad"
"""On a top-level model call: autograd was recording a graph (a backward may follow)."""
ATTR_GENERATE_PHASE: Final = "xsp.generate.phase"
"""On a model call inside ``generate()``: ``prefill`` (the first) or ``decode``."""
ATTR_GENERATE_SAMPLES: Final = "xsp.generate.samples"
"""On a ``generate()`` step: the input sequences it was given (what its throughput counts; its
model calls may run on more, one a beam, or fewer)."""
ATTR_GENERATE_TOKEN: Final = "xsp.generate.token_index"
"""On a model call inside ``generate()``: the index of the token it produces (0 for prefill)."""
INPUT_NEXT_NAME: Final = "DataLoader.__next__"
"""The name of an input wait for a batch."""
INPUT_ITER_NAME: Final = "DataLoader.__iter__"
"""The name of an input wait for ``iter(loader)``: an epoch's workers starting, where they do not persist."""
ATTR_INPUT_WORKERS: Final = "xsp.input.num_workers"
"""On an input wait: the DataLoader's ``num_workers``."""
ATTR_INPUT_PIN_MEMORY: Final = "xsp.input.pin_memory"
"""On an input wait: the DataLoader's ``pin_memory``."""
ATTR_INPUT_PERSISTENT_WORKERS: Final = "xsp.input.persistent_workers"
"""On an input wait: the DataLoader's ``persistent_workers``."""
ATTR_INPUT_PREFETCH_FACTOR: Final = "xsp.input.prefetch_factor"
"""On an input wait from worker processes: the DataLoader's ``prefetch_factor`` (batches each
worker keeps loaded ahead)."""
ATTR_COLLECTIVE_OP: Final = "xsp.collective.op"
"""On a collective: the operation (``all_reduce``, ``broadcast``...)."""
ATTR_COLLECTIVE_GROUP: Final = "xsp.collective.group"
"""On a collective: the process group's name (``0`` for the default group)."""
ATTR_COLLECTIVE_GROUP_SIZE: Final = "xsp.collective.group_size"
ATTR_COLLECTIVE_SEQ: Final = "xsp.collective.seq"
"""On a collective: its number among this process's collectives on its group (every rank
calls a group's collectives in the same order, so it matches the same call across ranks)."""
ATTR_COLLECTIVE_ASYNC: Final = "xsp.collective.async"
ATTR_COLLECTIVE_BACKEND: Final = "xsp.collective.backend"
ATTR_COLLECTIVE_DTYPE: Final = "xsp.collective.dtype"
ATTR_COLLECTIVE_BUCKET: Final = "xsp.collective.bucket"
"""On a DDP gradient all-reduce: the reducer's bucket index (0 is the last layers' gradients)."""
ATTR_COLLECTIVE_WORK_NS: Final = "xsp.collective.work_ns"
"""On an asynchronous collective whose completion xsp saw (DDP's buckets): nanoseconds from its
launch (the span's start) to its completion. The span itself is the launch."""
ATTR_STEP_SLOW: Final = "xsp.step.slow_over_median"
"""On a step an always-on session found slow: its duration over the running median of steps."""
ATTR_GC_GENERATION: Final = "xsp.gc.generation"
"""The oldest generation a garbage collection (``gc`` span) examined: 0, 1 or 2 (a full collection)."""
ATTR_GC_COLLECTED: Final = "xsp.gc.collected"
"""Objects a garbage collection found unreachable and freed."""
ATTR_GC_UNCOLLECTABLE: Final = "xsp.gc.uncollectable"
"""Objects a garbage collection found unreachable but could not free (``gc.garbage``)."""
ATTR_BACKWARD_END: Final = "xsp.backward_end"
"""On a backward layer span whose end is not its own last graph node's: a :class:`BackwardEnd`."""
BACKWARD_END_ATTRIBUTES: Final = {end: json.dumps({ATTR_BACKWARD_END: end.value}) for end in BackwardEnd}
"""The ``attributes`` of a backward layer span whose end is a :class:`BackwardEnd`, as built."""
ATTR_RANK: Final = "xsp.rank"
"""On every span of a distributed job: the rank that recorded it."""
ATTR_PROCESS_ID: Final = "process.pid"
"""On the spans of a child process the session followed: its process id (OpenTelemetry's key)."""
ATTR_INPUT_WORKER: Final = "xsp.input.worker"
"""On a DataLoader worker's ``fetch`` span: the worker's id (0 to ``num_workers - 1``)."""

COLUMN_ATTRIBUTE_KEYS: Final[dict[str, str]] = {
    THREAD_ID: ATTR_THREAD_ID,
    DEVICE_ID: ATTR_DEVICE_ID,
    STREAM_ID: ATTR_STREAM_ID,
    CORRELATION_ID: ATTR_CORRELATION_ID,
    STEP: ATTR_STEP,
    PATH: ATTR_PATH,
    MODULE_TYPE: "xsp.layer.type",
    INPUT_SHAPES: "xsp.layer.input_shapes",
    OUTPUT_SHAPES: "xsp.layer.output_shapes",
    PARAM_COUNT: "xsp.layer.param_count",
    CALL_DEPTH: "xsp.layer.call_depth",
    EXEC_INDEX: "xsp.layer.exec_index",
    SOURCE: "xsp.layer.source",
    # OpenTelemetry's semantic conventions for code (stable names; code.filepath, code.lineno and
    # code.function are their deprecated forms)
    CALL_FILE: "code.file.path",
    CALL_LINE: "code.line.number",
    CALL_FUNCTION: "code.function.name",
    BATCH_SIZE: "xsp.batch_size",
    GRID: "xsp.kernel.grid",
    BLOCK: "xsp.kernel.block",
    REGISTERS_PER_THREAD: "xsp.kernel.registers_per_thread",
    SHARED_MEMORY_BYTES: "xsp.kernel.shared_memory_bytes",
    BYTES: "xsp.memory.bytes",
    COPY_KIND: "xsp.memory.copy_kind",
    FLOPS: "xsp.flops",
    SEQUENCE_NUMBER: "xsp.operator.sequence_number",
    EXTERNAL_ID: "xsp.external_id",
    LEVELED_RUN: "xsp.session.leveled.run",
    DURATION_CI_NS: "xsp.session.leveled.ci_ns",
    OVERHEAD_NS: "xsp.session.leveled.overhead_ns",
    RANK: ATTR_RANK,
    PROCESS_ID: ATTR_PROCESS_ID,
    SAMPLING: "xsp.step.sampling",
    GRAPH_NODE_ID: "xsp.cuda.graph_node_id",
}
"""Typed columns exported as span attributes, and the key each one gets."""
