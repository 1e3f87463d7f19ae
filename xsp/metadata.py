"""What a trace records about where and how it was made."""

from __future__ import annotations

import os
import platform
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from xsp._version import __version__
from xsp.schema import SCHEMA_VERSION


def device_description() -> str:
    """The accelerator in use, or the CPU model: ``cuda:0 NVIDIA H100 80GB HBM3`` / ``cpu ...``."""
    import torch  # here, not at the top: reading and reporting traces must not pay torch's import

    try:
        if torch.cuda.is_available():
            index = torch.cuda.current_device()
            return f"cuda:{index} {torch.cuda.get_device_name(index)}"
    except Exception:  # a broken driver must not stop the trace being written
        pass
    return f"cpu {cpu_model()}".strip()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def default_service_name() -> str:
    """``OTEL_SERVICE_NAME``, else the running script's name, else ``python``."""
    from_env = os.environ.get("OTEL_SERVICE_NAME", "").strip()
    if from_env:
        return from_env
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
    return script or "python"


def environment() -> dict[str, Any]:
    """Versions, host and process of this run."""
    import torch

    return {
        "xsp_version": __version__,
        "schema_version": SCHEMA_VERSION,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "platform": platform.platform(),
        "device": device_description(),
        "command": list(sys.argv),
        "created_at": datetime.now(timezone.utc).isoformat(),
    }
