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
from xsp.core.schema import SCHEMA_VERSION


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


def service_name_from_environment() -> str | None:
    """The service name OpenTelemetry's standard variables give: ``OTEL_SERVICE_NAME``, else
    ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES`` (``key=value`` pairs, comma-separated,
    values percent-encoded), else None. OpenTelemetry's own precedence: the first wins."""
    from_env = os.environ.get("OTEL_SERVICE_NAME", "").strip()
    if from_env:
        return from_env
    for pair in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, equals, value = pair.partition("=")
        if equals and key.strip() == "service.name" and value.strip():
            from urllib.parse import unquote

            return unquote(value.strip())
    return None


def default_service_name() -> str:
    """The standard variables' service name (:func:`service_name_from_environment`), else the
    running script's name, else ``python``."""
    from_env = service_name_from_environment()
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
        **compute_settings(),
    }


def compute_settings() -> dict[str, Any]:
    """The CPUs this process may use, PyTorch's thread pools and math settings, and each visible
    GPU's properties (the keys Kineto writes in ``deviceProperties``): what recommendations
    (:func:`xsp.analysis.recommend`) read."""
    import torch

    try:
        available = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        available = os.cpu_count() or 0
    settings: dict[str, Any] = {
        "cpu_count": os.cpu_count() or 0,
        "cpus_available": available,
        "torch_num_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
    }
    try:
        if torch.cuda.is_available():
            properties = []
            for index in range(torch.cuda.device_count()):
                found = torch.cuda.get_device_properties(index)
                properties.append({"id": index, "name": found.name, "totalGlobalMem": int(found.total_memory),
                                   "computeMajor": int(found.major), "computeMinor": int(found.minor),
                                   "numSms": int(found.multi_processor_count)})
            settings["device_properties"] = properties
    except Exception:  # a broken driver must not stop the trace being written
        pass
    return settings


def memory_peaks() -> dict[str, Any]:
    """Peak memory of this process so far against capacity: the host's peak resident set and
    physical memory, and on each GPU PyTorch's caching allocator has used, its peak allocated
    and reserved bytes and the device's total (what ``memory_near_capacity`` reads)."""
    import torch

    peaks: dict[str, Any] = {"devices": []}
    try:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
        peaks["host_peak_rss_bytes"] = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale
        peaks["host_total_bytes"] = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ImportError, ValueError, OSError, AttributeError):  # not a POSIX host
        pass
    try:
        if torch.cuda.is_initialized():
            for index in range(torch.cuda.device_count()):
                peaks["devices"].append({
                    "device": index, "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(index)),
                    "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(index)),
                    "total_bytes": int(torch.cuda.get_device_properties(index).total_memory)})
    except Exception:  # a broken driver must not stop the trace being written
        pass
    return peaks
