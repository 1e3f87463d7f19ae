"""GPU analyses: kernels, their attribution to layers and operators, copies, syncs, idle time
and launch overhead. Each function takes a Trace (or span table) and returns a DataFrame.

Durations are in microseconds (``_us``) unless a column says otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from xsp.analysis.compiled import compiled_callers, compiled_keys, compiled_layer_name
from xsp.analysis.in_order import grouped_in_order, row_places
from xsp.analysis.model import spans_of
from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind
from xsp.io.trace import Trace
from xsp.record.compiled_kernels import CALLED_SEPARATOR, LayerShare, kernel_layers
from xsp.table.walks import (
    nearest_ancestor,
    nearest_marked,
    of_level,
    parent_positions,
    text_codes,
    texts_at,
    union_length,
)

SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaStreamWaitEvent",
              "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize")
_ACTIVITY_KINDS = [SpanKind.KERNEL.value, SpanKind.MEMCPY.value, SpanKind.MEMSET.value]


def _kind_mask(spans: pd.DataFrame, *kinds: SpanKind) -> np.ndarray:
    return (spans[col.LEVEL] == Level.KERNEL.value).to_numpy() & spans[col.KIND].isin(
        [k.value for k in kinds]).to_numpy()


def _name_at(spans: pd.DataFrame, positions: np.ndarray) -> np.ndarray:
    return texts_at(spans[col.NAME], positions)


CAPTURE_SITE_COLUMNS = ("process", "node", "original", "o0", "o1", "o2", "operator", "layer")
CHAIN_COLUMNS = ("process", "node", "o0", "o1", "o2", "layer_span_id", "layer", "path", "depth")


@dataclass(frozen=True)
class CaptureSites:
    """Where the CUDA graph nodes of a trace were captured (the ``graph_node`` spans that mark
    them): per node a replay runs (its process and node id, a clone resolved to the node it was
    cloned from), the innermost operator and layer above its mark (``operator``, ``layer``:
    names, None where none), and the layers above it (``chains``: one row a layer, its span id,
    name, path and depth, 0 the outermost). Made of the :func:`capture_site_parts` of every part
    of a trace (:func:`capture_sites`), so that a window can attribute the replays of a graph
    another window captured."""

    nodes: pd.DataFrame
    """Indexed by ``process`` and ``node``: ``o0``-``o2`` (the captured mark's place),
    ``operator``, ``layer``."""
    chains: pd.DataFrame
    """Per captured mark (``o0``-``o2``), its layers, innermost first."""


def capture_site_parts(spans: pd.DataFrame, places: np.ndarray | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The marks of graph nodes in ``spans`` (a trace or a window of whole trees of it; ``places``:
    its rows' places in the loaded trace, row positions where None) and the layers above each:
    what :func:`capture_sites` puts together."""
    places = row_places(len(spans)) if places is None else places
    marks = (np.flatnonzero((spans[col.KIND] == SpanKind.GRAPH_NODE.value).to_numpy())
             if col.GRAPH_NODE_ID in spans and len(spans) else np.zeros(0, dtype=np.int64))
    nodes = spans[col.GRAPH_NODE_ID].array[marks] if len(marks) else pd.array([], dtype="Int64")
    marks = marks[~pd.isna(nodes)] if len(marks) else marks
    if not len(marks):
        return (pd.DataFrame({name: pd.Series(dtype=object if name in ("operator", "layer") else np.int64)
                              for name in CAPTURE_SITE_COLUMNS}),
                pd.DataFrame({name: pd.Series(dtype=object if name in ("layer", "path") else np.int64)
                              for name in CHAIN_COLUMNS}))
    parents = parent_positions(spans)
    layers = of_level(spans, Level.LAYER)
    process = _process_keys(spans)[marks]
    node = np.asarray(spans[col.GRAPH_NODE_ID].array[marks], dtype=np.int64)
    # a clone (made by the instantiation) names the node it was cloned from
    originals = [json.loads(text or "{}").get("original_node_id", 0)
                 for text in spans[col.ATTRIBUTES].iloc[marks].fillna("{}")]
    at = places[marks]
    sites = pd.DataFrame({
        "process": process, "node": node, "original": np.asarray(originals, dtype=np.int64),
        "o0": at[:, 0], "o1": at[:, 1], "o2": at[:, 2],
        "operator": _name_at(spans, nearest_ancestor(spans, of_level(spans, Level.OPERATOR), parents)[marks]),
        "layer": _name_at(spans, nearest_ancestor(spans, layers, parents)[marks])})
    rows: list[np.ndarray] = []  # (mark index, layer position, depth) per layer above each mark
    for index, mark in enumerate(marks.tolist()):
        ancestors, above = [], parents[mark]  # the mark's layer ancestors, innermost first
        while above >= 0:
            if layers[above]:
                ancestors.append(int(above))
            above = parents[above]
        if ancestors:
            chain = np.array(ancestors, dtype=np.int64)
            rows.append(np.column_stack([np.full(len(chain), index), chain,
                                         np.arange(len(chain) - 1, -1, -1, dtype=np.int64)]))
    found = np.concatenate(rows) if rows else np.zeros((0, 3), dtype=np.int64)
    owner, layer = found[:, 0], found[:, 1]
    chains = pd.DataFrame({
        "process": process[owner], "node": node[owner], "o0": at[owner, 0], "o1": at[owner, 1], "o2": at[owner, 2],
        "layer_span_id": spans[col.SPAN_ID].to_numpy(dtype=np.int64)[layer], "layer": _name_at(spans, layer),
        "path": texts_at(spans[col.PATH], layer), "depth": found[:, 2]})
    return sites, chains


def capture_sites(parts: Sequence[tuple[pd.DataFrame, pd.DataFrame]]) -> CaptureSites:
    """The :class:`CaptureSites` of a trace, of the :func:`capture_site_parts` of its parts."""
    if not parts:
        parts = [capture_site_parts(pd.DataFrame())]
    marks = pd.concat([part[0] for part in parts], ignore_index=True).sort_values(["o0", "o1", "o2"], kind="stable")
    chains = pd.concat([part[1] for part in parts], ignore_index=True)
    captured: dict[tuple[int, int], int] = {}
    original_of: dict[tuple[int, int], tuple[int, int]] = {}
    for position, (process, node, original) in enumerate(zip(
            marks["process"].tolist(), marks["node"].tolist(), marks["original"].tolist())):
        key = (process, node)
        if original:  # a clone: CUPTI may also have said it made it (inside the instantiation)
            original_of[key] = (process, original)
        else:
            captured.setdefault(key, position)
    resolved: dict[tuple[int, int], int] = {}
    for key in {*captured, *original_of}:
        at, hops = key, 0
        while at in original_of and hops < 8:  # a clone is never the captured node, whatever else was said
            at, hops = original_of[at], hops + 1
        if at in captured:
            resolved[key] = captured[at]
    chosen = marks.iloc[list(resolved.values())][["o0", "o1", "o2", "operator", "layer"]]
    nodes = chosen.set_index(pd.MultiIndex.from_tuples(list(resolved), names=["process", "node"]) if resolved
                             else pd.MultiIndex.from_arrays([[], []], names=["process", "node"]))
    return CaptureSites(nodes, chains.drop(columns=["process", "node"]).drop_duplicates(ignore_index=True))


def _own_sites(spans: pd.DataFrame) -> CaptureSites:
    """The :class:`CaptureSites` of ``spans``' own marks (none made where it has none: the common case)."""
    if col.GRAPH_NODE_ID not in spans or not (spans[col.KIND] == SpanKind.GRAPH_NODE.value).any():
        return capture_sites([])
    return capture_sites([capture_site_parts(spans)])


def _captured_at(spans: pd.DataFrame, rows: np.ndarray, sites: CaptureSites) -> pd.DataFrame:
    """For each of ``rows`` (GPU activities) run by a graph node captured in the trace, the place of
    the mark where it was captured and the operator and layer above it (NaN place: no such node)."""
    found = pd.DataFrame({"o0": np.full(len(rows), np.nan), "o1": np.nan, "o2": np.nan,
                          "operator": np.full(len(rows), None, dtype=object),
                          "layer": np.full(len(rows), None, dtype=object)})
    if col.GRAPH_NODE_ID not in spans or not len(rows) or sites.nodes.empty:
        return found
    wanted = spans[col.GRAPH_NODE_ID].array[rows]
    known = np.flatnonzero(~pd.isna(wanted))
    if not len(known):
        return found
    query = pd.MultiIndex.from_arrays([_process_keys(spans)[rows[known]], np.asarray(wanted[known], dtype=np.int64)],
                                      names=["process", "node"])
    matched = sites.nodes.reindex(query)
    for name in ("o0", "o1", "o2"):
        found.loc[known, name] = matched[name].to_numpy(dtype=np.float64)
    for name in ("operator", "layer"):
        values = matched[name].to_numpy(dtype=object)
        found.loc[known, name] = np.where(pd.isna(values), None, values)
    return found


def _process_keys(spans: pd.DataFrame) -> np.ndarray:
    """One number per process that recorded each span (its rank and child process id together)."""
    keys = np.zeros(len(spans), dtype=np.int64)
    for column, scale in ((col.RANK, 1 << 32), (col.PROCESS_ID, 1)):
        if column in spans:
            keys += (spans[column].to_numpy(dtype=np.float64, na_value=-1).astype(np.int64) + 1) * scale
    return keys


def kernel_table(source: Trace | pd.DataFrame, sites: CaptureSites | None = None) -> pd.DataFrame:
    """One row per kernel, with where it came from.

    Columns: ``step``, ``name``, ``start_ns``, ``duration_us``, ``device_id``, ``stream_id``,
    ``correlation_id``, ``grid``, ``block``, ``registers_per_thread``, ``shared_memory_bytes``,
    ``bytes`` (memory the kernel moved, when recorded), ``launch`` (the CUDA API call),
    ``launch_duration_us``, ``launch_delay_us`` (kernel start minus launch start), ``operator``
    (innermost operator above the launch), ``layer`` (innermost layer), ``graph_node_id`` (the
    CUDA graph node that ran it, when a graph launch did), ``replayed`` (True for such a kernel
    whose node was captured in the trace: its ``operator`` and ``layer`` are those that made the
    node at capture, not those around the replay), ``span_id``. ``sites``: where the trace's
    graph nodes were captured (:func:`capture_sites`; by default, of ``source``'s own marks).
    """
    spans = spans_of(source)
    parents = parent_positions(spans)
    kernels = np.flatnonzero(_kind_mask(spans, SpanKind.KERNEL))
    launch = parents[kernels]
    operator_of = nearest_ancestor(spans, of_level(spans, Level.OPERATOR), parents)
    layer_of = nearest_ancestor(spans, of_level(spans, Level.LAYER), parents)
    captured = _captured_at(spans, kernels, _own_sites(spans) if sites is None else sites)
    replayed = captured["o0"].notna().to_numpy()
    # a replayed kernel is where its node was captured, where the capture's tree is in the trace
    captured_operator, captured_layer = captured["operator"].to_numpy(), captured["layer"].to_numpy()
    operator = np.where(replayed & captured["operator"].notna().to_numpy(), captured_operator,
                        _name_at(spans, operator_of[kernels]))
    layer = np.where(replayed & captured["layer"].notna().to_numpy(), captured_layer,
                     _name_at(spans, layer_of[kernels]))
    graph_nodes = (spans[col.GRAPH_NODE_ID].array[kernels] if col.GRAPH_NODE_ID in spans
                   else pd.array([pd.NA] * len(kernels), dtype="Int64"))
    starts = spans[col.START_NS].to_numpy(dtype=np.int64)
    durations = spans[col.DURATION_NS].to_numpy(dtype=np.float64)
    has_launch = launch >= 0
    rows = spans.iloc[kernels]
    return pd.DataFrame({
        "step": rows[col.STEP].to_numpy(), "name": rows[col.NAME].to_numpy(),
        "start_ns": starts[kernels], "duration_us": durations[kernels] / 1e3,
        "device_id": rows[col.DEVICE_ID].to_numpy(), "stream_id": rows[col.STREAM_ID].to_numpy(),
        "correlation_id": rows[col.CORRELATION_ID].to_numpy(), "grid": rows[col.GRID].to_numpy(),
        "block": rows[col.BLOCK].to_numpy(), "registers_per_thread": rows[col.REGISTERS_PER_THREAD].to_numpy(),
        "shared_memory_bytes": rows[col.SHARED_MEMORY_BYTES].to_numpy(), "bytes": rows[col.BYTES].to_numpy(),
        "launch": _name_at(spans, launch),
        "launch_duration_us": np.where(has_launch, durations[np.maximum(launch, 0)] / 1e3, np.nan),
        "launch_delay_us": np.where(has_launch, (starts[kernels] - starts[np.maximum(launch, 0)]) / 1e3, np.nan),
        "operator": operator, "layer": layer,
        "graph_node_id": graph_nodes, "replayed": replayed,
        "span_id": rows[col.SPAN_ID].to_numpy(),
    })


REPLAYED_LAYER_COLUMNS = ("step", "launch_span_id", "layer", "path", "depth", "kernels", "kernel_us",
                          "gpu_start_ns", "gpu_end_ns")


def replayed_layers(source: Trace | pd.DataFrame, sites: CaptureSites | None = None) -> pd.DataFrame:
    """The layer tree of every CUDA graph replay, with the time of the GPU work it ran.

    A replay runs kernels (copies, sets) without calling the model's modules; each ran a graph
    node, and the node was made inside a layer while the graph was captured. Per replay (its
    ``cudaGraphLaunch``) and per layer that made nodes of it, at capture, or holds such layers:
    ``kernels`` (its own and its children's activities), ``kernel_us`` (their summed duration),
    ``gpu_start_ns`` and ``gpu_end_ns`` (the first start and last end). ``layer`` and ``path``
    are the capture-time layer's (its path names the capture step); ``depth`` 0 is the outermost
    layer. Replays whose graph was captured before the trace began have no row: their kernels
    keep their launch (``kernel_table``'s ``replayed`` is False).

    Columns: ``step``, ``launch_span_id``, ``layer``, ``path``, ``depth``, ``kernels``,
    ``kernel_us``, ``gpu_start_ns``, ``gpu_end_ns``. ``sites``: as :func:`kernel_table` takes them.
    """
    spans = spans_of(source)
    activities = np.flatnonzero(_kind_mask(spans, SpanKind.KERNEL, SpanKind.MEMCPY, SpanKind.MEMSET))
    sites = _own_sites(spans) if sites is None else sites
    captured = _captured_at(spans, activities, sites)
    kept = captured["o0"].notna().to_numpy()
    if not kept.any():
        return pd.DataFrame({name: [] for name in REPLAYED_LAYER_COLUMNS})
    activities = activities[kept]
    marks = captured.loc[kept, ["o0", "o1", "o2"]].astype(np.int64).reset_index(drop=True)
    # one row per (activity, layer above its mark): by mark, then activity, then layer innermost first
    pairs = marks.assign(activity=np.arange(len(marks))).merge(sites.chains, on=["o0", "o1", "o2"])
    if pairs.empty:
        return pd.DataFrame({name: [] for name in REPLAYED_LAYER_COLUMNS})
    pairs = pairs.sort_values(["o0", "o1", "o2", "activity", "depth"], ascending=[True, True, True, True, False],
                              kind="stable")
    owner = pairs["activity"].to_numpy(dtype=np.int64)
    parents = parent_positions(spans)
    starts = spans[col.START_NS].to_numpy(dtype=np.int64)[activities]
    ends = spans[col.END_NS].to_numpy(dtype=np.int64)[activities]
    launch = parents[activities]
    ids = spans[col.SPAN_ID].to_numpy(dtype=np.int64)
    frame = pd.DataFrame({
        "launch": launch[owner], "layer_at": pairs["layer_span_id"].to_numpy(dtype=np.int64),
        "depth": pairs["depth"].to_numpy(dtype=np.int64),
        "duration_us": (ends - starts)[owner] / 1e3, "start": starts[owner], "end": ends[owner],
        "step": spans[col.STEP].to_numpy(dtype=np.float64, na_value=np.nan)[activities][owner],
        "layer": pairs["layer"].to_numpy(dtype=object), "path": pairs["path"].to_numpy(dtype=object)})
    grouped = frame.groupby(["launch", "layer_at", "depth"], sort=False).agg(
        step=("step", "first"), kernels=("duration_us", "size"), kernel_us=("duration_us", "sum"),
        gpu_start_ns=("start", "min"), gpu_end_ns=("end", "max"), layer=("layer", "first"),
        path=("path", "first")).reset_index()
    result = pd.DataFrame({
        "step": pd.array(grouped["step"].to_numpy(), dtype="Float64").astype("Int64"),
        "launch_span_id": pd.array(np.where(grouped["launch"] >= 0, ids[np.maximum(grouped["launch"], 0)], 0),
                                   dtype="Int64"),
        "layer": grouped["layer"].to_numpy(dtype=object), "path": grouped["path"].to_numpy(dtype=object),
        "depth": grouped["depth"], "kernels": grouped["kernels"], "kernel_us": grouped["kernel_us"],
        "gpu_start_ns": grouped["gpu_start_ns"], "gpu_end_ns": grouped["gpu_end_ns"]})
    result.loc[grouped["launch"].to_numpy() < 0, "launch_span_id"] = pd.NA
    return result.sort_values(["launch_span_id", "gpu_start_ns", "depth"], kind="stable").reset_index(drop=True)


REPLAY_KEYS = ["depth", "layer"]
REPLAY_SUMS = ["replays", "kernels", "kernel_ns"]
REPLAY_FIRST = ["unlaunched", "launch_span_id", "gpu_start_ns"]
"""A capture-time layer's first row in :func:`replayed_layers`' order (replays without a launch last)."""


def replay_sums(replayed: pd.DataFrame) -> pd.DataFrame:
    """:func:`replayed_layers`' rows added up per capture-time layer (``depth``, ``layer``):
    ``replays``, ``kernels`` and ``kernel_ns`` (whole nanoseconds: exact in any order), with the
    layer's first row in that table's order (``unlaunched``, ``launch_span_id``,
    ``gpu_start_ns``). The tables of parts of a trace (a replay lies in one part) added up by
    :func:`replay_sums_added` are the whole trace's."""
    launch = replayed["launch_span_id"].astype("Int64")
    frame = pd.DataFrame({
        "depth": replayed["depth"].to_numpy(dtype=np.int64), "layer": replayed["layer"].to_numpy(dtype=object),
        "launch": launch, "kernels": replayed["kernels"].to_numpy(dtype=np.int64),
        "kernel_ns": whole_ns(replayed["kernel_us"]).to_numpy(dtype=np.float64),
        "unlaunched": launch.isna().to_numpy(), "launch_span_id": launch.fillna(0).to_numpy(dtype=np.int64),
        "gpu_start_ns": replayed["gpu_start_ns"].to_numpy(dtype=np.int64)})
    group = frame.groupby(REPLAY_KEYS, sort=False)
    sums = group.agg(replays=("launch", "nunique"), kernels=("kernels", "sum"), kernel_ns=("kernel_ns", "sum"))
    return sums.join(group[REPLAY_FIRST].first()).reset_index()[[*REPLAY_KEYS, *REPLAY_SUMS, *REPLAY_FIRST]]


def replay_sums_added(parts: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """The :func:`replay_sums` of parts of a trace, as one table."""
    every = pd.concat(list(parts), ignore_index=True) if parts else replay_sums(
        pd.DataFrame({name: [] for name in REPLAYED_LAYER_COLUMNS}))
    every = every.sort_values([*REPLAY_FIRST, "depth"], kind="stable")
    group = every.groupby(REPLAY_KEYS, sort=False)
    return group[REPLAY_SUMS].sum().join(group[REPLAY_FIRST].first()).reset_index()[
        [*REPLAY_KEYS, *REPLAY_SUMS, *REPLAY_FIRST]]


def replay_table_of(sums: pd.DataFrame) -> pd.DataFrame:
    """Per capture-time layer of CUDA graph replays (``depth``, ``layer``): ``replays``,
    ``kernels`` and ``kernel_us``, most kernel time first (of :func:`replay_sums`)."""
    ordered = sums.sort_values([*REPLAY_FIRST, "depth"], kind="stable")
    ordered = ordered.sort_values("kernel_ns", ascending=False, kind="stable").reset_index(drop=True)
    return pd.DataFrame({"depth": ordered["depth"].to_numpy(dtype=np.int64),
                         "layer": ordered["layer"].to_numpy(dtype=object),
                         "replays": ordered["replays"].to_numpy(dtype=np.int64),
                         "kernels": ordered["kernels"].to_numpy(dtype=np.int64),
                         "kernel_us": ordered["kernel_ns"].to_numpy(dtype=np.float64) / 1e3})


def kernels_by_name(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Kernels aggregated by name, most time first.

    Columns: ``name``, ``count``, ``total_us``, ``mean_us``, ``min_us``, ``max_us``,
    ``share`` (of all kernel time).
    """
    spans = spans_of(source)
    kernels = np.flatnonzero(_kind_mask(spans, SpanKind.KERNEL))
    # positions into two columns, not a boolean mask over the whole table: that copies every column;
    # and names as codes, not a Python string per kernel (hundreds of thousands of long names)
    codes, names = text_codes(spans[col.NAME])
    codes = codes[kernels]
    durations = pd.Series(spans[col.DURATION_NS].to_numpy(dtype=np.float64)[kernels], index=codes,
                          name="duration_ns")
    # sums of whole nanoseconds, exact in any order: the tables of parts of a trace add up to its own
    grouped = durations.groupby(level=0, sort=False, observed=True).agg(
        count="size", total_us="sum", min_us="min", max_us="max") / [1, 1e3, 1e3, 1e3]
    grouped.insert(2, "mean_us", grouped["total_us"] / grouped["count"])
    grouped["count"] = grouped["count"].astype(np.int64)
    found = grouped.index.to_numpy(dtype=np.int64)
    grouped.insert(0, "name", pd.Index(names.take(pa.array(found, mask=found < 0)).to_pylist(),
                                       dtype=object if not len(found) else None))
    grouped = grouped.reset_index(drop=True)
    total = grouped["total_us"].sum()
    grouped["share"] = grouped["total_us"] / total if total else np.nan
    return grouped.sort_values("total_us", ascending=False, kind="stable").reset_index(drop=True)


def _kernel_time_by(source: Trace | pd.DataFrame, key: str) -> pd.DataFrame:
    kernels = kernel_table(source)
    kernels = kernels.assign(duration_ns=whole_ns(kernels["duration_us"]))
    attributed = kernels[kernels[key].notna()]
    grouped = attributed.groupby(key, sort=False, observed=True)["duration_ns"].agg(
        kernels="size", kernel_us="sum").reset_index()
    grouped["kernel_us"] /= 1e3
    grouped["mean_kernel_us"] = grouped["kernel_us"] / grouped["kernels"]
    total = kernels["duration_ns"].sum() / 1e3
    grouped["share"] = grouped["kernel_us"] / total if total else np.nan
    return grouped.sort_values("kernel_us", ascending=False, kind="stable").reset_index(drop=True)


def compiled_kernel_shares(spans: pd.DataFrame, kernels: np.ndarray, layers_of_kernel: dict[str, list[LayerShare]]
                           ) -> pd.DataFrame:
    """The layers of compiled code each kernel at ``kernels`` (span positions) is counted on: a
    kernel inductor generated (``triton_poi_fused_mul_0``) by its name, and a kernel launched by
    an operator that compiled code calls as it is (``aten::mm``'s cuBLAS kernel) by that call
    (:mod:`xsp.analysis.compiled`); shares as the layer table has them
    (:func:`xsp.record.compiled_kernels.kernel_layers`).

    Columns: ``kernel`` (place in ``kernels``), ``layer`` (named under the layer or model that
    ran the compiled code: ``model.blocks.0``), ``share`` (of the kernel's time).
    """
    empty = pd.DataFrame({"kernel": pd.Series(dtype=np.int64), "layer": pd.Series(dtype=object),
                          "share": pd.Series(dtype=np.float64)})
    if not layers_of_kernel or not len(kernels):
        return empty
    parents = parent_positions(spans)
    operators = np.flatnonzero(of_level(spans, Level.OPERATOR))
    # the kernels' and the operators' keys at once: one walk of the tree, one list of keys
    codes, keys = compiled_keys(spans, np.concatenate([kernels, operators]), parents)
    kernel_codes, operator_codes = codes[:len(kernels)], codes[len(kernels):]
    known = np.array([isinstance(key, str) and key in layers_of_kernel for key in keys], dtype=bool)
    is_called = known & np.array([isinstance(key, str) and CALLED_SEPARATOR in key for key in keys], dtype=bool)
    called_key_of = np.full(len(spans), -1, dtype=np.int64)
    called_key_of[operators] = np.where(is_called[operator_codes], operator_codes, -1)
    calling = nearest_marked(parents, called_key_of >= 0)[kernels]
    callers, is_module, backward = compiled_callers(spans, parents)
    # each kernel's source of shares: its own name's, else the call's that launched it
    source = np.where(known[kernel_codes], kernel_codes,
                      np.where(calling >= 0, called_key_of[np.maximum(calling, 0)], -1))
    table = pd.DataFrame([(code, path, share) for code in np.unique(source[source >= 0]).tolist()
                          for path, _, share in layers_of_kernel[str(keys[code])]],
                         columns=["source", "path", "share"])
    placed = np.flatnonzero(source >= 0)
    if not len(placed) or table.empty:
        return empty
    caller = callers[kernels[placed]]
    found = pd.DataFrame({"kernel": placed, "source": source[placed], "backward": backward[kernels[placed]],
                          "caller": texts_at(spans[col.NAME], np.where(is_module[caller], caller, -1))}
                         ).merge(table, on="source")
    # a name per distinct (caller, path, direction), not per kernel
    named, distinct = pd.factorize(pd.MultiIndex.from_frame(found[["caller", "path", "backward"]]))
    names = np.array([compiled_layer_name(caller, path, bool(back)) for caller, path, back in distinct],
                     dtype=object)
    return pd.DataFrame({"kernel": found["kernel"].to_numpy(dtype=np.int64), "layer": names[named],
                         "share": found["share"].to_numpy(dtype=np.float64)}).sort_values("kernel", kind="stable")


def kernel_time_per_layer(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Kernel time attributed to the innermost layer above each launch, over all steps. Given a
    trace (not a bare table), the kernels of compiled code count on its layers, by their shares
    (:func:`compiled_kernel_shares`); the rest of their time stays on the launch's layer.

    Columns: ``layer``, ``kernels``, ``kernel_us``, ``mean_kernel_us``, ``share`` (of all kernel time).
    """
    layers_of_kernel = kernel_layers(source.metadata) if isinstance(source, Trace) else {}
    if not layers_of_kernel:
        return _kernel_time_by(source, "layer")
    spans = spans_of(source)
    table = kernel_table(source)
    shares = compiled_kernel_shares(spans, np.flatnonzero(_kind_mask(spans, SpanKind.KERNEL)), layers_of_kernel)
    if shares.empty:
        return _kernel_time_by(source, "layer")
    durations = table["duration_us"].to_numpy(dtype=np.float64)
    given = np.bincount(shares["kernel"].to_numpy(), weights=shares["share"].to_numpy(), minlength=len(table))
    kept = table.assign(duration_us=durations * (1.0 - given))
    moved = pd.DataFrame({"layer": shares["layer"].to_numpy(),
                          "duration_us": durations[shares["kernel"].to_numpy()] * shares["share"].to_numpy()})
    stays = (given < 1.0 - 1e-9) & kept["layer"].notna().to_numpy()
    whole = pd.concat([kept[stays][["layer", "duration_us"]].assign(kernel=np.flatnonzero(stays)),
                       moved.assign(kernel=shares["kernel"].to_numpy())], ignore_index=True)
    # a kernel shared by layers is one of each one's kernels, its mean over what each holds of it
    grouped = whole.groupby("layer", sort=False, observed=True).agg(
        kernels=("kernel", "nunique"), kernel_us=("duration_us", "sum")).reset_index()
    grouped["mean_kernel_us"] = grouped["kernel_us"] / grouped["kernels"]
    total = durations.sum()
    grouped["share"] = grouped["kernel_us"] / total if total else np.nan
    return grouped.sort_values("kernel_us", ascending=False, kind="stable").reset_index(drop=True)


def kernel_time_per_operator(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Kernel time attributed to the innermost operator above each launch, over all steps.

    Columns: ``operator``, ``kernels``, ``kernel_us``, ``mean_kernel_us``, ``share``.
    """
    return _kernel_time_by(source, "operator")


def gpu_vs_cpu_per_layer(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Per layer span: wall time, the time its kernels keep the GPU busy, and the rest.

    ``gpu_us`` is the union of the intervals of the kernels, copies and sets launched inside
    the layer (concurrent kernels counted once); ``cpu_us`` is ``duration_us - gpu_us``, at
    least 0: XSP's "layer non-GPU time". Kernels may run after their layer returned, so
    ``gpu_us`` can exceed ``duration_us``.

    Columns: ``step``, ``name``, ``module_type``, ``duration_us``, ``gpu_us``, ``cpu_us``, ``kernels``.
    """
    spans = spans_of(source)
    parents = parent_positions(spans)
    layers_mask = of_level(spans, Level.LAYER)
    activities = np.flatnonzero(_kind_mask(spans, SpanKind.KERNEL, SpanKind.MEMCPY, SpanKind.MEMSET))
    starts = spans[col.START_NS].to_numpy(dtype=np.int64)
    ends = spans[col.END_NS].to_numpy(dtype=np.int64)
    owners: dict[int, list[int]] = {}
    for activity in activities.tolist():
        ancestor = parents[activity]
        while ancestor >= 0:
            if layers_mask[ancestor]:
                owners.setdefault(int(ancestor), []).append(activity)
            ancestor = parents[ancestor]
    layer_rows = np.flatnonzero(layers_mask)
    gpu_ns = np.array([union_length(starts[owners[r]], ends[owners[r]]) if r in owners else 0
                       for r in layer_rows.tolist()], dtype=np.float64)
    duration = (ends[layer_rows] - starts[layer_rows]).astype(np.float64)
    rows = spans.iloc[layer_rows]
    return pd.DataFrame({
        "step": rows[col.STEP].to_numpy(), "name": rows[col.NAME].to_numpy(),
        "module_type": rows[col.MODULE_TYPE].to_numpy(), "duration_us": duration / 1e3,
        "gpu_us": gpu_ns / 1e3, "cpu_us": np.maximum(duration - gpu_ns, 0) / 1e3,
        "kernels": [len(owners.get(r, ())) for r in layer_rows.tolist()],
    })


GPU_VS_CPU_KEYS = ["name"]
GPU_VS_CPU_SUMS = ["duration_ns", "gpu_ns", "cpu_ns", "kernels"]


def gpu_vs_cpu_sums(per_layer: pd.DataFrame, places: np.ndarray | None = None) -> pd.DataFrame:
    """:func:`gpu_vs_cpu_per_layer` added up per layer name, in the order they first ran:
    ``duration_ns``, ``gpu_ns``, ``cpu_ns`` (whole nanoseconds: exact in any order), ``kernels``;
    with each name's first place (``places``: one per row, default its position;
    :mod:`xsp.analysis.in_order`). Added up by name, the sums of parts of a trace are the whole
    trace's."""
    rows = pd.DataFrame({"name": per_layer["name"], "duration_ns": whole_ns(per_layer["duration_us"]),
                         "gpu_ns": whole_ns(per_layer["gpu_us"]), "cpu_ns": whole_ns(per_layer["cpu_us"]),
                         "kernels": per_layer["kernels"].astype(np.int64)})
    rows = rows[rows["name"].notna()]
    chosen = (places if places is not None else row_places(len(per_layer)))[rows.index.to_numpy()]
    return grouped_in_order(rows.reset_index(drop=True), chosen, GPU_VS_CPU_KEYS, GPU_VS_CPU_SUMS)


def memory_operations(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Copies by direction and sets: count, time, bytes and achieved bandwidth.

    Columns: ``kind`` (memcpy/memset), ``direction`` (HtoD, DtoH, DtoD, ... ; empty for sets),
    ``count``, ``total_us``, ``bytes``, ``bandwidth_gb_s`` (bytes over busy time).
    """
    spans = spans_of(source)
    rows = spans[_kind_mask(spans, SpanKind.MEMCPY, SpanKind.MEMSET)]
    frame = pd.DataFrame({
        "kind": rows[col.KIND].to_numpy(), "direction": rows[col.COPY_KIND].fillna("").to_numpy(),
        "duration_ns": rows[col.DURATION_NS].to_numpy(dtype=np.float64),
        "bytes": rows[col.BYTES].fillna(0).to_numpy(dtype=np.float64)})
    grouped = frame.groupby(["kind", "direction"], sort=True, observed=True).agg(
        count=("duration_ns", "size"), total_us=("duration_ns", "sum"), bytes=("bytes", "sum")).reset_index()
    grouped["total_us"] /= 1e3
    grouped["bandwidth_gb_s"] = np.where(grouped["total_us"] > 0, grouped["bytes"] / (grouped["total_us"] * 1e3),
                                         np.nan)
    return grouped


def synchronization(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Time the host spent blocked in CUDA synchronisation calls, and sync events on streams.

    Columns: ``where`` (host/device), ``name``, ``count``, ``total_us``, ``mean_us``.
    """
    spans = spans_of(source)
    host = spans[(spans[col.LEVEL] == Level.CUDA_API.value)
                 & spans[col.NAME].str.startswith(SYNC_CALLS).fillna(False)]
    device = spans[_kind_mask(spans, SpanKind.SYNC)]
    frames = []
    for where, rows in (("host", host), ("device", device)):
        if len(rows):
            grouped = rows[col.DURATION_NS].astype("float64").groupby(rows[col.NAME], observed=True).agg(
                count="size", total_us="sum").reset_index().rename(columns={col.NAME: "name"})
            grouped["total_us"] /= 1e3
            grouped["mean_us"] = grouped["total_us"] / grouped["count"]
            grouped.insert(0, "where", where)
            frames.append(grouped)
    if not frames:
        return pd.DataFrame(columns=["where", "name", "count", "total_us", "mean_us"])
    return pd.concat(frames, ignore_index=True).sort_values("total_us", ascending=False).reset_index(drop=True)


def _busy_and_gaps(starts: np.ndarray, ends: np.ndarray, launches: np.ndarray) -> tuple[int, int, int]:
    """Busy time, host-bound idle and other idle between the activities of one stream."""
    order = np.argsort(starts, kind="stable")
    starts, ends, launches = starts[order], ends[order], launches[order]
    covered_end = np.maximum.accumulate(ends)
    gaps = starts[1:] - covered_end[:-1]
    idle = gaps > 0
    # the next activity was launched after the stream went idle: the GPU waited for the host
    host_bound = idle & (launches[1:] >= covered_end[:-1])
    return (union_length(starts, ends), int(gaps[host_bound].sum()), int(gaps[idle & ~host_bound].sum()))


ACTIVITY_TIME_COLUMNS = ("step", "device_id", "stream_id", "start", "end", "launch", "launch_end", "launch_step",
                         "kernel")


def activity_times(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Every GPU activity (kernel, copy, set) of the trace, what :func:`gpu_utilization` reads of
    it: ``step``, ``device_id``, ``stream_id``, ``start`` and ``end`` (ns), ``launch`` and
    ``launch_end`` (the start and end of the API call that launched it, the least int64 where
    none did), ``launch_step`` (whether that call has a step), ``kernel`` (whether it is a
    kernel). Made of whole trees each, these tables add up (concatenated) to the whole trace's."""
    spans = spans_of(source)
    parents = parent_positions(spans)
    rows = np.flatnonzero(_kind_mask(spans, SpanKind.KERNEL, SpanKind.MEMCPY, SpanKind.MEMSET))
    starts = spans[col.START_NS].to_numpy(dtype=np.int64)
    ends = spans[col.END_NS].to_numpy(dtype=np.int64)
    launch = parents[rows]
    has_launch = launch >= 0
    at = np.maximum(launch, 0)
    least = np.iinfo(np.int64).min
    return pd.DataFrame({"step": spans[col.STEP].to_numpy()[rows], "device_id": spans[col.DEVICE_ID].to_numpy()[rows],
                         "stream_id": spans[col.STREAM_ID].to_numpy()[rows], "start": starts[rows],
                         "end": ends[rows], "launch": np.where(has_launch, starts[at], least),
                         "launch_end": np.where(has_launch, ends[at], least),
                         "launch_step": has_launch & spans[col.STEP].notna().to_numpy(dtype=bool)[at],
                         "kernel": (spans[col.KIND] == SpanKind.KERNEL.value).to_numpy(dtype=bool)[rows]})


UTILIZATION_COLUMNS = ("step", "device_id", "stream_id", "activities", "window_us", "busy_us", "host_bound_idle_us",
                       "other_idle_us", "utilization")


def gpu_utilization(source: Trace | pd.DataFrame, per_stream: bool = True) -> pd.DataFrame:
    """Busy and idle GPU time per step and stream (or, with ``per_stream=False``, per step and
    device: the device is idle only while all its streams are, and ``stream_id`` is empty).

    Within each (step, device, stream), the window runs from the first activity's start to
    the last one's end. Idle gaps are split into ``host_bound_idle_us`` (the next activity's
    launch call began after the stream went idle: the GPU waited for the CPU) and
    ``other_idle_us`` (it was launched earlier and waited on something else).

    Columns: ``step``, ``device_id``, ``stream_id``, ``activities``, ``window_us``, ``busy_us``,
    ``host_bound_idle_us``, ``other_idle_us``, ``utilization`` (busy over window).
    """
    frame = activity_times(source)
    if not per_stream:
        frame["stream_id"] = pd.NA
    out = []
    for (step, device, stream), group in frame.groupby(["step", "device_id", "stream_id"], dropna=False, sort=True,
                                                       observed=True):
        busy, host_bound, other = _busy_and_gaps(group["start"].to_numpy(), group["end"].to_numpy(),
                                                 group["launch"].to_numpy())
        window = int(group["end"].max() - group["start"].min())
        out.append({"step": step, "device_id": device, "stream_id": stream, "activities": len(group),
                    "window_us": window / 1e3, "busy_us": busy / 1e3, "host_bound_idle_us": host_bound / 1e3,
                    "other_idle_us": other / 1e3, "utilization": busy / window if window else np.nan})
    return pd.DataFrame(out, columns=list(UTILIZATION_COLUMNS))


LAUNCH_SUM_COLUMNS = ("kernels", "launch_us", "kernel_us", "kernels_shorter_than_launch", "launch_delay_us",
                      "delays")


def launch_sums(kernels: pd.DataFrame) -> pd.DataFrame:
    """What :func:`launch_overhead` adds up per step of ``kernels`` (a :func:`kernel_table`):
    ``step``, ``kernels``, ``launch_us``, ``kernel_us``, ``kernels_shorter_than_launch``,
    ``launch_delay_us`` (summed) and ``delays`` (kernels with a launch). Summed by step, the
    tables of parts of a trace are the whole trace's."""
    exact = kernels.assign(shorter=kernels["duration_us"] < kernels["launch_duration_us"],
                           **{name: whole_ns(kernels[name]) for name in _LAUNCH_TIMES})
    sums = exact.groupby("step", dropna=False, sort=True, observed=True).agg(
        kernels=("duration_us", "size"), launch_us=("launch_duration_us", "sum"), kernel_us=("duration_us", "sum"),
        kernels_shorter_than_launch=("shorter", "sum"), launch_delay_us=("launch_delay_us", "sum"),
        delays=("launch_delay_us", "count")).reset_index()
    sums[["launch_us", "kernel_us", "launch_delay_us"]] /= 1e3
    return sums


_LAUNCH_TIMES = ("duration_us", "launch_duration_us", "launch_delay_us")


def whole_ns(microseconds: pd.Series) -> pd.Series:
    """Times in µs made of whole nanoseconds, as those nanoseconds: their sums are exact in any
    order, so that the tables of parts of a trace add up to the whole trace's to the last digit."""
    return np.rint(microseconds.astype("float64") * 1e3)


def launch_overhead_of(sums: pd.DataFrame) -> pd.DataFrame:
    """:func:`launch_overhead` from :func:`launch_sums` (one row a step)."""
    overhead = sums.assign(
        launch_to_kernel=np.where(sums["kernel_us"] > 0, sums["launch_us"] / sums["kernel_us"].where(
            sums["kernel_us"] > 0, 1.0), np.nan),
        mean_launch_delay_us=sums["launch_delay_us"] / sums["delays"].where(sums["delays"] > 0, np.nan))
    return overhead[["step", "kernels", "launch_us", "kernel_us", "launch_to_kernel", "kernels_shorter_than_launch",
                     "mean_launch_delay_us"]]


def launch_overhead(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Launch cost against kernel time, per step.

    Columns: ``step``, ``kernels``, ``launch_us`` (time in the launching API calls),
    ``kernel_us``, ``launch_to_kernel`` (ratio), ``kernels_shorter_than_launch``,
    ``mean_launch_delay_us`` (kernel start minus launch start).
    """
    return launch_overhead_of(launch_sums(kernel_table(source)))
