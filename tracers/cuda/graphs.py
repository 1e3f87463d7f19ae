"""CUDA graphs: the nodes made while a graph is captured, and cloned when it is instantiated.

A replayed graph runs its kernels without a launch call each: CUPTI reports them under the one
``cudaGraphLaunch``, with the id of the graph node that ran each (``graphNodeId``) and, from
CUPTI 13.4, of the node it was instantiated from (``sourceGraphNodeId``). To attach them to the
layers and operators that made them, xsp has CUPTI call it back when a graph node is made
(``CUPTI_CBID_RESOURCE_GRAPHNODE_CREATED``: during stream capture, inside the captured launch,
on the capturing thread) and, before 13.4, cloned (``GRAPHNODE_CLONED``: when the graph is
instantiated, the executable graph's nodes are clones, and a replay reports the clone's id).
Only nodes whose runs CUPTI records are marked: kernels, copies and sets.
Each callback records one mark (node id, original node id, graph id, node type, thread, time):
nothing is resolved on the hot path. The marks become ``graph_node`` spans, instants on the
thread that made them, which the tree builder places under the layer and operator running
there, as every other span (:mod:`xsp.table.parents`); :func:`xsp.analysis.gpu.kernel_table`
then follows a replayed kernel's node id to its mark. Callbacks come only while graphs are
built, never per replay.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from xsp.core import schema as col
from xsp.core.clock import now_ns
from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level, SpanKind

RESOURCE_DOMAIN: Final = 3
"""``CUPTI_CB_DOMAIN_RESOURCE``."""
NODE_CREATED: Final = 13
"""``CUPTI_CBID_RESOURCE_GRAPHNODE_CREATED``."""
NODE_CLONED: Final = 20
"""``CUPTI_CBID_RESOURCE_GRAPHNODE_CLONED``."""
CALLBACKS: Final = (NODE_CREATED, NODE_CLONED)
SOURCE_NODE_VERSION: Final = 130400
"""From this CUPTI API version (13.4) kernel, copy and set records carry ``sourceGraphNodeId``, the
captured node a replayed one was instantiated from: the clones need no callback."""
RECORDED_NODE_TYPES: Final = frozenset({0, 1, 2})
"""The node types whose runs CUPTI records (kernel, memcpy, memset): the only ones marked."""

NODE_TYPES: Final = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait event",
                     7: "event record", 8: "semaphore signal", 9: "semaphore wait", 10: "memory alloc",
                     11: "memory free", 12: "batch memory op", 13: "conditional"}
"""``CUgraphNodeType`` names (cuda.h)."""
MADE: Final = {NODE_CREATED: "made", NODE_CLONED: "cloned"}
"""How a mark's node came to be, in its span's attributes (``made``): made (in a stream capture,
or as an executable graph's node when it is instantiated) or cloned from another node."""


GraphNodeMark = tuple[int, int, int, int, int, int, int]
"""One mark: callback id, node id, original node id (clones), graph id, node type, native thread id,
time (ns)."""


@dataclass
class GraphNodeMarks:
    """The marks of the graph nodes made since the last window took them (any thread adds)."""

    marks: list[GraphNodeMark] = field(default_factory=list)
    """``(callback id, node id, original node id (0: none), graph id, node type, thread, time ns)``."""
    unreadable: int = 0
    """Callbacks whose data could not be read (counted in the trace's dropped records)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_callback(self, cupti: Any, domain: int, cbid: int, cbdata: Any) -> None:
        """CUPTI's callback for xsp's subscription (on the thread making the node, inside the CUDA
        call): one mark per node made or cloned; never raises into CUPTI."""
        try:
            if int(domain) != RESOURCE_DOMAIN or int(cbid) not in CALLBACKS:
                return
            resource = cbdata if hasattr(cbdata, "resource_descriptor") else cupti.ResourceData.from_ptr(int(cbdata))
            graph = cupti.GraphData.from_ptr(int(resource.resource_descriptor))
            if int(graph.node_type) not in RECORDED_NODE_TYPES:
                return
            node_id = int(cupti.get_graph_node_id(int(graph.node)))
            original = int(cupti.get_graph_node_id(int(graph.original_node))) if (
                int(cbid) == NODE_CLONED and int(graph.original_node)) else 0
            graph_id = int(cupti.get_graph_id(int(graph.graph))) if int(graph.graph) else 0
            mark = (int(cbid), node_id, original, graph_id, int(graph.node_type), threading.get_native_id(), now_ns())
        except Exception:
            with self.lock:
                self.unreadable += 1
            return
        with self.lock:
            self.marks.append(mark)

    def take(self, closed_ns: int | None = None, held_since_ns: Mapping[int, int] | None = None,
             ) -> list[GraphNodeMark]:
        """The marks of a window taken at ``closed_ns`` (None: every mark); those made after it,
        or on a thread it left for later since that thread's time in ``held_since_ns``
        (``Window.held_since_ns``), stay for the next."""
        held = held_since_ns or {}
        with self.lock:
            marks, self.marks = self.marks, []
            if closed_ns is None:
                return marks
            now: list[GraphNodeMark] = []
            for mark in marks:
                later = mark[6] >= closed_ns or mark[6] >= held.get(mark[5], closed_ns)
                (self.marks if later else now).append(mark)
        return now

    def take_unreadable(self) -> int:
        with self.lock:
            count, self.unreadable = self.unreadable, 0
        return count


def graph_node_rows(marks: list[GraphNodeMark]) -> pd.DataFrame:
    """One ``graph_node`` span per mark: an instant at the time and on the thread that made the
    node, its id in ``graph_node_id``, the rest in the attributes (``made``: made or cloned,
    ``graph_id``, ``node_type``, ``original_node_id`` of a clone)."""
    if not marks:
        return pd.DataFrame()
    cbid, node, original, graph, node_type, thread, at = (np.array(column, dtype=np.int64) for column in zip(*marks))
    names = [f"{MADE.get(int(c), 'made')} {NODE_TYPES.get(int(t), 'graph')} node" for c, t in zip(cbid, node_type)]
    attributes = [json.dumps({"made": MADE.get(int(c), "made"), "graph_id": int(g),
                              "node_type": NODE_TYPES.get(int(t), str(int(t))),
                              **({"original_node_id": int(o)} if o else {})})
                  for c, g, t, o in zip(cbid, graph, node_type, original)]
    count = len(marks)
    return pd.DataFrame({
        col.LEVEL: np.full(count, Level.KERNEL.value, dtype=object),
        col.KIND: np.full(count, SpanKind.GRAPH_NODE.value, dtype=object),
        col.NAME: np.array(names, dtype=object),
        col.START_NS: at,
        col.END_NS: at,
        col.THREAD_ID: thread,
        col.GRAPH_NODE_ID: node,
        col.ATTRIBUTES: np.array(attributes, dtype=object),
    })
