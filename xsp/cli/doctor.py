"""``xsp doctor``: what can be traced on this machine, and why not."""

from __future__ import annotations

import argparse
import os
from typing import Any

from rich.table import Table

from xsp.cli._common import console


def register(commands: Any) -> None:
    parser = commands.add_parser("doctor", help="list tracers and whether they can run here",
                                 description="List every tracer with 'available' or the reason it is not, "
                                             "and the OTLP target the environment names.")
    parser.set_defaults(handler=run)


def tracer_rows() -> list[tuple[str, str, str]]:
    """(tracer, level, "available" or the reason it is not) for every known tracer."""
    from xsp.tracers.registry import tracer_classes  # imports torch: only when the command runs

    rows = []
    for name, cls in sorted(tracer_classes().items()):
        if isinstance(cls, str):
            rows.append((name, "?", cls))
            continue
        try:
            reason = cls().available()
        except Exception as exc:
            reason = f"availability check failed: {exc}"
        rows.append((name, cls.level.value, "available" if reason is None else reason))
    return rows


def run(options: argparse.Namespace) -> int:
    from xsp.core.metadata import environment
    from xsp.export.target import OtlpTarget, probe

    out = console()
    env = environment()
    out.print(f"xsp {env['xsp_version']}  torch {env['torch_version']}  python {env['python_version']}")
    out.print(f"device: {env['device']}")
    table = Table(title="Tracers")
    for name in ("tracer", "level", "status"):
        table.add_column(name)
    for name, level, status in tracer_rows():
        table.add_row(name, level, status if status == "available" else f"[yellow]{status}[/yellow]")
    out.print(table)
    from xsp.tracers.cuda_api import record_path_here

    path, why, pairing = record_path_here()
    cost = {"C": "xsp's C record path", "Python (cupti-python)": "one Python object per record: the CUDA levels "
            "cost many times more"}.get(path, "the CUDA levels cannot run")
    out.print(f"CUDA records: {path} ({cost})" + (f": {why}" if why and path != "none" else ""))
    if pairing is not None:
        out.print(f"[yellow]{pairing}[/yellow]")
    target = OtlpTarget.resolve(environ=os.environ)
    if target is None:
        out.print("OTLP: no endpoint configured (set OTEL_EXPORTER_OTLP_ENDPOINT or use --otlp)")
    else:
        reason = probe(target)
        out.print(f"OTLP: {target.protocol.value} {target.endpoint}: "
                  + ("reachable" if reason is None else f"[yellow]{reason}[/yellow]"))
    return 0
