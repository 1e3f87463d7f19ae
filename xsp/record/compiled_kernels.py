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
import re
from pathlib import Path
from typing import Any, Final

from xsp.record.sites import library_file, library_folders

METADATA_KEY: Final = "compiled_kernels"
"""In the operator tracer's details (``metadata["tracer_details"]["operator"]``): kernel name to
the frames of each operator it fuses (see :func:`kernel_sources`)."""
AMBIGUOUS_KEY: Final = "compiled_kernels_ambiguous"
"""Kernel names that two compiles gave different sources: their time stays on the line that
called the compiled code."""
EXTERN_PREFIX: Final = "extern_kernels."
"""Inductor's name for an operator compiled code calls as it is (``extern_kernels.addmm``): it runs
as the operator (``aten::addmm``), under no name of its own, so its source is not kept."""
GRAPH_PREFIX: Final = re.compile(r"^graph_\d+_")
"""Inductor names a CPU kernel's profiler event ``graph_<N>_<kernel>``."""
_FRAME: Final = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\s*$')

Frame = tuple[str, int, str, str]
"""A frame of a kernel's operator: file, line, function, and the line's code."""


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


def sources_of_metrics(provenance_texts: list[str]) -> dict[str, list[list[Frame]]]:
    """Kernel name (without inductor's ``:handle``) to its operators' frames, from the JSON texts
    of a compile's ``inductor_provenance``."""
    sources: dict[str, list[list[Frame]]] = {}
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
            if name.startswith(EXTERN_PREFIX):
                continue
            chains = [chain for chain in (users_frames(parse_stack_trace(t)) for t in traces if isinstance(t, str))
                      if chain]
            if chains:
                sources.setdefault(name, [])
                sources[name].extend(chain for chain in chains if chain not in sources[name])
    return sources


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
