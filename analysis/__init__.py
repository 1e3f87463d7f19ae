"""Analyses of xsp span tables: the tree, steps and paths, and the tables reports print.

Every analysis is a plain function that takes an :class:`xsp.Trace` (or its span table)
and returns a pandas DataFrame with documented columns. Nothing here plots or prints.
"""

from xsp.analysis import hierarchy, structure
from xsp.analysis.layers import layer_table, layer_type_summary, top_layers
from xsp.analysis.model import model_latency, model_summary

__all__ = [
    "hierarchy", "structure", "layer_table", "layer_type_summary", "top_layers",
    "model_latency", "model_summary",
]
