"""Where each kernel that ``torch.compile`` generated comes from in the user's code.

Inductor fuses a model's operators into kernels of its own (``cpp_fused_mul_relu_0`` on CPU,
``triton_poi_fused_mul_relu_0`` on GPU) that no Python line runs. With its provenance tracking
on (``torch._inductor.config.trace.provenance_tracking_level``), it writes down, as it
generates each kernel, the stack traces of the operators the kernel fuses: the frames of the
user's code from the compiled function down to the line of each operator. Dynamo keeps them in
its compilation metrics (``torch._dynamo.utils.get_compilation_metrics()``, the last 64
compiles), from a fresh compile and from one that FX's graph cache answered alike.

While a session records operators, :class:`xsp.tracers.compiled_kernels.CompiledKernels` turns
the tracking on (and makes CPU kernels visible to the operator level:
``cpp.enable_kernel_profile``) for the compiles made during the session, and reads the metrics
as windows close and at the end. Nothing is done per kernel launch: the mapping is made at
compile time, and kept in the trace's metadata (see :func:`kernel_sources`), where the analyses
read it.
"""

from __future__ import annotations

import ast
import functools
import json
import linecache
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Final

from xsp.record.sites import library_file, library_folders

METADATA_KEY: Final = "compiled_kernels"
"""In the operator tracer's details (``metadata["tracer_details"]["operator"]``): kernel name to
the frames of each operator it fuses (see :func:`kernel_sources`); an operator that compiled code
calls as it is, by its :func:`called_key`."""
LAYERS_KEY: Final = "compiled_kernel_layers"
"""In the operator tracer's details: kernel name (or :func:`called_key`) to the layers of the
operators it fuses, each as ``[path, module type, share]`` (see :func:`kernel_layers`)."""
CALLED_SEPARATOR: Final = "@"
"""Between an operator's name and its compile's id in a :func:`called_key` (no kernel name has one)."""
AMBIGUOUS_KEY: Final = "compiled_kernels_ambiguous"
"""Kernel names that two compiles gave different sources: their time stays on the line that
called the compiled code."""
REBASED_KEY: Final = "compiled_kernels_rebased"
"""In the operator tracer's details: how many stack traces of compiles that FX's graph cache
answered named another program's files and were taken from this program's graphs instead
(:func:`rebased_provenance`)."""
STALE_KEY: Final = "compiled_kernels_stale"
"""How many of the kernels' stack traces FX's graph cache gave matched none of this program's
code (:func:`rebased_provenance`), and were left out."""
EXTERN_PREFIX: Final = "extern_kernels."
"""Inductor's name for an operator compiled code calls as it is (``extern_kernels.addmm``): it runs
as the operator (``aten::addmm``), under no name of its own, so its source is not kept."""
TORCH_OPS_PREFIX: Final = "torch.ops."
"""Inductor's name for an operator it falls back to (``torch.ops.aten.convolution.default``)."""
GRAPH_PREFIX: Final = re.compile(r"^graph_\d+_")
"""Inductor names a CPU kernel's profiler event ``graph_<N>_<kernel>``."""
_ROOT: Final = re.compile(r"^[LG]\['(?P<name>[^']*)'\]\.?")
"""The root of a module path in dynamo's ``nn_module_stack`` (``L['self'].blocks.0``): the local or
global that held the module (``self``: the compiled module itself)."""
NAMED_MARK: Final = "/"
"""Before a :data:`LayerShare`'s path that is a whole layer name (``/model.blocks.0``): a module a
compiled *function* called, named as the variable that held it (as an eager run names a model
after its variable), not below the layer that called the compiled code."""
_FILE_NAME: Final = re.compile(r'File "[^"]*"')
_FRAME: Final = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\s*$')

Frame = tuple[str, int, str, str]
"""A frame of a kernel's operator: file, line, function, and the line's code."""
LayerShare = tuple[str, str, float]
"""A layer a compiled kernel's time is counted on: its module path below the compiled module
(``blocks.0.fc``), its module type (``Linear``), and its share of the kernel's time."""
LayerHints = dict[str, dict[str, str]]
"""An operator's stack trace (inductor's text, as its provenance gives it) to the module paths
that ran it and their types: the path is ``""`` for an operator of the compiled module itself."""


def kernel_name(event_name: str) -> str:
    """The generated kernel's name in an operator or kernel span's name (``graph_0_cpp_fused_x_0``
    is ``cpp_fused_x_0``)."""
    return GRAPH_PREFIX.sub("", event_name, count=1)


def parse_stack_trace(text: str) -> list[Frame]:
    """The frames of one of inductor's stack traces (Python's traceback format), outermost first."""
    frames: list[Frame] = []
    lines = text.splitlines()
    for position, line in enumerate(lines):
        found = _FRAME.match(line)
        if found is None:
            continue
        following = lines[position + 1] if position + 1 < len(lines) else ""
        code = "" if _FRAME.match(following) else following.strip()
        frames.append((found["file"], int(found["line"]), found["function"], code))
    return frames


def users_frames(chain: list[Frame]) -> list[Frame]:
    """``chain`` without library frames (torch's, xsp's wrapper of module calls, which dynamo
    traced through): the user's own, as call sites name them (:mod:`xsp.record.sites`), their
    functions by qualified name (``Net.forward``, as a code object's ``co_qualname``)."""
    folders = library_folders()
    return [(file, line, qualified_name(file, line, function), code) for file, line, function, code in chain
            if not library_file(file, folders)]


def qualified_name(file: str, line: int, function: str) -> str:
    """The qualified name of the function ``function`` whose code holds ``line`` of ``file``
    (``function`` itself where the file cannot be read or parsed)."""
    for qualified, first, last in _functions_of(file):
        if first <= line <= last and qualified.rsplit(".", 1)[-1] == function:
            return qualified
    return function


@functools.lru_cache(maxsize=256)
def _functions_of(file: str) -> tuple[tuple[str, int, int], ...]:
    """Each function of ``file``: qualified name, first and last line, innermost last."""
    try:
        tree = ast.parse(Path(file).read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return ()
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append((name, child.lineno, child.end_lineno or child.lineno))
                visit(child, name + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return tuple(sorted(found, key=lambda item: item[2] - item[1]))  # the narrowest (innermost) first


def users_blocks(trace: str) -> list[tuple[str, str]]:
    """A stack trace's frames as ``(file, text)``, each text its frame's lines (the ``File`` line,
    its code, Python's marks of the columns that ran), library frames left out (torch's, and
    xsp's wrapper of module calls, which a compile made while it was in place traced through)."""
    folders = library_folders()
    blocks: list[tuple[str, str]] = []
    for line in trace.splitlines(keepends=True):
        found = _FRAME.match(line)
        if found is not None:
            blocks.append((found["file"], line))
        elif blocks:
            blocks[-1] = (blocks[-1][0], blocks[-1][1] + line)
    return [(file, text) for file, text in blocks if not library_file(file, folders)]


def whole_shape(trace: str) -> str:
    """A stack trace with its files left out, every frame kept (torch's and xsp's too)."""
    return _FILE_NAME.sub('File ""', trace)


def whole_code_shape(trace: str) -> str:
    """:func:`whole_shape` with its line numbers left out too: every frame's function and code."""
    return _LINE_NUMBER.sub(", line ,", whole_shape(trace))


def trace_shape(trace: str) -> str:
    """A stack trace's own frames (:func:`users_blocks`) with their files left out: their lines,
    functions and code (with Python's marks of the columns that ran), as the same code in another
    file gives it."""
    return "".join(_FILE_NAME.sub('File ""', text) for _, text in users_blocks(trace))


def names_code_not_there(trace: str) -> bool:
    """Whether a stack trace's own frames name a file that is not here, or a line of a file whose
    code is not the trace's (the file was edited since the trace was made). Frames of code run by
    ``exec`` (``<string>``, a notebook's cell as ``<ipython-input-...>``) are not looked at."""
    for file, text in users_blocks(trace):
        for file_name, line, _, code in parse_stack_trace(text):
            if file_name.startswith("<") or not code:
                continue
            if not os.path.isfile(file) or linecache.getline(file, line).strip() != code:
                return True
    return False


_LINE_NUMBER: Final = re.compile(r", line \d+,")


def code_shape(trace: str) -> str:
    """A stack trace with its files and line numbers left out: its frames' functions and code, as
    the same code moved to other lines (a line added above it) gives it."""
    return _LINE_NUMBER.sub(", line ,", trace_shape(trace))


def rebased_provenance(provenance_texts: list[str], current_traces: Iterable[str]) -> tuple[list[str], int, int]:
    """A compile's ``inductor_provenance`` with its stack traces as this program's graphs give them
    (``current_traces``, the traces of the graphs seen at compile time), and how many traces were
    replaced.

    FX's graph cache answers a compile of a graph it has seen with the kernels *and* the
    provenance of the compile that first made them, which may have been another program's:
    another file with the same model's code, an earlier notebook kernel (its cells are files of
    their own), a script since moved. Their stack traces name that program's files, which no
    graph of this one has: the kernels' lines pointed there, and none of the compile's layers was
    found. A trace that the current graphs do not hold is replaced by the one current trace of
    the same shape, tried closest first: every frame on the same lines (:func:`whole_shape`: the
    same code in another file), every frame's code (:func:`whole_code_shape`: on other lines, a
    line added above it since), then the program's own frames alike (:func:`trace_shape`,
    :func:`code_shape`: the cached compile traced through xsp's wrapper). Where none has it and
    it names code that is not there (:func:`names_code_not_there`: a file since edited, or another
    machine's), it is left out (returned third, counted), and the kernel's time stays on the line
    that called the compiled code; where several have it, it stays as inductor gave it, as does a
    stack trace of code run by ``exec`` (no code to compare)."""
    current = set(current_traces)
    # (two traces alike in the program's own frames, one of them through xsp's wrapper, are told
    # apart by the first two shapes)
    shapes = (whole_shape, whole_code_shape, trace_shape, code_shape)
    by_shape: list[dict[str, list[str]]] = [{} for _ in shapes]
    for trace in current:
        for index, shape in enumerate(shapes):
            by_shape[index].setdefault(shape(trace), []).append(trace)
    replaced = dropped = 0

    def rebased(trace: Any) -> Any:
        nonlocal replaced, dropped
        if not isinstance(trace, str) or trace in current:
            return trace
        matched = False
        for index, shape in enumerate(shapes):
            same = by_shape[index].get(shape(trace), [])
            matched = matched or bool(same)
            if len(same) == 1:
                replaced += 1
                return same[0]
        if not matched and names_code_not_there(trace):
            dropped += 1
            return None
        return trace

    texts: list[str] = []
    for text in provenance_texts:
        try:
            mapping = json.loads(text)
        except ValueError:
            mapping = None
        if not isinstance(mapping, dict):
            texts.append(text)
            continue
        before = replaced + dropped
        mapping = {key: [trace for trace in map(rebased, traces) if trace is not None]
                   if isinstance(traces, list) else traces for key, traces in mapping.items()}
        texts.append(json.dumps(mapping) if replaced + dropped > before else text)
    return texts, replaced, dropped


def provenance_entries(provenance_texts: list[str], compile_id: str) -> Iterator[tuple[str, list[str], bool]]:
    """Each entry of a compile's ``inductor_provenance`` (JSON texts; damaged ones skipped): its
    name without inductor's ``:handle`` (an operator called as it is: its :func:`called_key` with
    ``compile_id``), its stack traces, and whether it is such an operator."""
    for text in provenance_texts:
        try:
            mapping = json.loads(text)
        except ValueError:
            continue
        if not isinstance(mapping, dict):
            continue
        for key, traces in mapping.items():
            if not isinstance(key, str) or not isinstance(traces, list):
                continue
            name = key.rsplit(":", 1)[0]
            operator = called_operator(name)
            yield (name if operator is None else called_key(operator, compile_id),
                   [trace for trace in traces if isinstance(trace, str)], operator is not None)


def sources_of_metrics(provenance_texts: list[str], compile_id: str = "") -> dict[str, list[list[Frame]]]:
    """Kernel name (without inductor's ``:handle``) to its operators' frames, from the JSON texts
    of a compile's ``inductor_provenance``; an operator the compiled code calls as it is, by its
    :func:`called_key` with ``compile_id`` (dynamo's id of the compile)."""
    sources: dict[str, list[list[Frame]]] = {}
    for name, traces, _ in provenance_entries(provenance_texts, compile_id):
        chains = [chain for chain in (users_frames(parse_stack_trace(trace)) for trace in traces) if chain]
        if chains:
            sources.setdefault(name, [])
            sources[name].extend(chain for chain in chains if chain not in sources[name])
    return sources


def module_path(dynamo_path: str) -> str:
    """A module's path as a :data:`LayerShare` keeps it, from dynamo's (``L['self'].blocks.0`` is
    ``blocks.0``, below the compiled module; ``L['model'].blocks.0`` is ``/model.blocks.0``: a
    compiled function's variable ``model``)."""
    root = _ROOT.match(dynamo_path)
    if root is None:
        return dynamo_path
    rest = dynamo_path[root.end():]
    if root["name"] == "self":
        return rest
    return NAMED_MARK + root["name"] + ("." + rest if rest else "")


def layer_hints(graph_module: Any) -> LayerHints:
    """The modules each operator's stack trace ran in, from the graph dynamo hands to inductor:
    each node keeps its stack trace and the stack of modules it was traced in
    (``nn_module_stack``, outermost first). Several modules share a trace where one line runs
    them all (``for block in self.blocks: x = block(x)``)."""
    hints: LayerHints = {}
    for node in graph_module.graph.nodes:
        trace = node.meta.get("stack_trace")
        if not trace or not isinstance(trace, str):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        innermost = list(stack.values())[-1] if stack else None
        path, module_type = ("", "") if innermost is None else (
            module_path(str(innermost[0])), getattr(innermost[1], "__name__", str(innermost[1])))
        hints.setdefault(trace, {})[path] = module_type
    return hints


def called_key(operator: str, compile_id: str) -> str:
    """How the sources and layers of an operator that compiled code calls as it is are keyed:
    by its name and its compile's id (``aten::addmm@0/0``), as two compiles call it for
    different lines and modules. The span of a compiled call names its compile id
    (``Torch-Compiled Region: 0/0``)."""
    return f"{operator}{CALLED_SEPARATOR}{compile_id}"


def called_operator(key: str) -> str | None:
    """The operator a key of inductor's provenance names where compiled code calls it as it is
    (``extern_kernels.addmm`` and ``torch.ops.aten.convolution.default`` are ``aten::addmm`` and
    ``aten::convolution``, as the operator level names their spans); None for a generated kernel."""
    for prefix, namespace in ((EXTERN_PREFIX, "aten"), (TORCH_OPS_PREFIX, None)):
        if key.startswith(prefix):
            rest = key[len(prefix):]
            if namespace is None:
                namespace, _, rest = rest.partition(".")
            return f"{namespace}::{rest.split('.', 1)[0]}" if namespace and rest else None
    return None


def _shares(traces: list[str], hints: LayerHints, per_module: bool) -> list[LayerShare]:
    shares: dict[tuple[str, str], float] = {}
    if per_module:  # one call, one module: each module that calls it has an equal share
        modules = {module for trace in traces for module in (hints.get(trace) or {}).items()}
        for module in modules:
            shares[module] = 1.0 / len(modules)
    else:  # a kernel's operators have equal shares, each split among the modules that ran it
        for trace in traces:
            of_trace = hints.get(trace) or {}
            for module in of_trace.items():
                shares[module] = shares.get(module, 0.0) + 1.0 / len(traces) / len(of_trace)
    return [(path, module_type, share) for (path, module_type), share in sorted(shares.items()) if path]


def layers_of_metrics(provenance_texts: list[str], hints: LayerHints, compile_id: str = ""
                      ) -> dict[str, list[LayerShare]]:
    """The layers the time of a compile's kernels is counted on, from the JSON texts of its
    ``inductor_provenance`` and the :func:`layer_hints` of its graphs: by generated kernel's
    name, and for an operator the compiled code calls as it is (``aten::addmm``) by its
    :func:`called_key` with ``compile_id``.

    The rules, as no record says which layer one run of a kernel served: a generated kernel's
    time is shared equally among the operators it fuses (its distinct stack traces), and an
    operator's share equally among the modules that ran its line (``for block in self.blocks``
    runs one line in each block). An operator called as it is runs for one module per call: each
    module whose code calls it has an equal share of each call. The share of code of the
    compiled module itself (no module below it), or of a stack trace without hints, is left out:
    it stays on the layer that called the compiled code."""
    traces_of: dict[str, list[str]] = {}
    called: set[str] = set()
    for name, traces, is_called in provenance_entries(provenance_texts, compile_id):
        if is_called:
            called.add(name)
        known = traces_of.setdefault(name, [])
        known.extend(trace for trace in traces if trace not in known)
    layers: dict[str, list[LayerShare]] = {}
    for name, traces in traces_of.items():
        shares = _shares(traces, hints, per_module=name in called)
        if shares:
            layers[name] = shares
    return layers


def kernel_layers(metadata: dict[str, Any]) -> dict[str, list[LayerShare]]:
    """From a trace's metadata: the layers each generated kernel's time is counted on (see
    :func:`layers_of_metrics`). Empty for a trace without compiled code, or one whose compiles
    were made before the session (their graphs were not seen)."""
    details = (metadata.get("tracer_details") or {}).get("operator") or {}
    found = details.get(LAYERS_KEY)
    layers: dict[str, list[LayerShare]] = {}
    for name, shares in (found if isinstance(found, dict) else {}).items():
        try:
            layers[str(name)] = [(str(path), str(module_type), float(share)) for path, module_type, share in shares]
        except (TypeError, ValueError):  # a damaged entry: that kernel stays on the calling layer
            continue
    return layers


def stale_traces(metadata: dict[str, Any]) -> int:
    """From a trace's metadata: how many of the kernels' stack traces FX's graph cache gave named
    code that was not there, and were left out (:func:`rebased_provenance`)."""
    details = (metadata.get("tracer_details") or {}).get("operator") or {}
    found = details.get(STALE_KEY)
    return found if isinstance(found, int) else 0


def kernel_sources(metadata: dict[str, Any]) -> dict[str, list[list[Frame]]]:
    """From a trace's metadata: each compiled kernel's operators, as chains of frames (outermost
    first; the last frame is the operator's line). Empty for a trace without compiled code."""
    details = (metadata.get("tracer_details") or {}).get("operator") or {}
    found = details.get(METADATA_KEY) or {}
    sources: dict[str, list[list[Frame]]] = {}
    for name, chains in found.items():
        try:
            sources[str(name)] = [[(str(f), int(line), str(function), str(code)) for f, line, function, code in chain]
                                  for chain in chains if chain]
        except (TypeError, ValueError):  # a damaged entry: that kernel stays on its calling line
            continue
    return sources
