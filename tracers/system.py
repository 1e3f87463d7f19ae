"""The ``system`` level: a sampler thread reading CPU, memory, GPU and energy counters.

Every ``interval_s`` (default 0.1 s: 10 Hz; ``XSP_SYSTEM_HZ`` changes it) the thread reads:

* the process: CPU time used (user + system, all threads, from the kernel's nanosecond clock
  of the process) and resident memory (psutil);
* the host: busy and total CPU time over all CPUs, memory in use (psutil), and the CPU
  packages' energy counters (RAPL, ``/sys/class/powercap/intel-rapl:N/energy_uj``) where
  they are readable (often only by root). The kernel counts the host's CPU time in clock ticks
  (10 ms); an interval shorter than :data:`MIN_HOST_TICKS` of them over all CPUs has no host
  CPU figure (it would read 0% or 100%);
* each NVIDIA GPU the process can see (nvidia-ml-py, imported as ``pynvml``): utilisation,
  memory used, power, SM clock and the total-energy counter (Volta and later; older GPUs
  integrate the power readings instead).

Each reading is turned into an interval since the previous one on the sampler thread (a
few subtractions) and appended to the recording; when a window is taken the recording asks
for one more reading, so a step that just ended is covered by its own window's samples.
A reading costs 0.1-0.3 ms of one core's time; the tracer's metadata says how much it cost here.

The level also records every garbage collection (``gc.callbacks``, :class:`GcPause`): two calls
of a small Python function per collection, 1-2 µs, against the 0.1 ms to 100 ms a collection
takes. At most :data:`MAX_GC_PAUSES` are kept per window; the metadata counts those dropped.
Collections on xsp's own threads (its imports, its windows) are xsp's cost, not the program's:
the metadata counts them and their time instead (``gc_collections_by_xsp``, ``gc_ms_by_xsp``).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Final

from xsp.core.clock import now_ns
from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level
from xsp.core.threads import on_own_thread, start_thread
from xsp.record.recording import Recording
from xsp.record.samples import EnergyMethod, GcPause, Sample, SampleSource, SystemMetric, gc_rows, sample_rows
from xsp.record.window import Window
from xsp.tracers.base import Tracer

DEFAULT_HZ: Final = 10.0
HZ_ENV: Final = "XSP_SYSTEM_HZ"
RAPL_ROOT: Final = Path("/sys/class/powercap")
MAX_GC_PAUSES: Final = 100_000
"""Garbage collections kept per window at most (a loop that allocates without pause collects
generation 0 some hundred times a second); those past it are counted, not kept."""
DROPPED_GC: Final = "garbage collections past a window's limit"
"""What the recording's drop count (which the session's end says) calls those."""

MIN_HOST_TICKS: Final = 10
"""The host's CPU time, counted over all CPUs in the kernel's clock ticks, that an interval needs
for a busy share: with fewer, one tick more or less moves it by over 10 points (a 4.5 ms session
read 100%, another 0%)."""

M = SystemMetric


def sampling_hz() -> float:
    """The sampling rate: ``XSP_SYSTEM_HZ`` when it is a positive number, else 10."""
    try:
        hz = float(os.environ.get(HZ_ENV, DEFAULT_HZ))
    except ValueError:
        return DEFAULT_HZ
    return hz if 0 < hz <= 1000 else DEFAULT_HZ


class _Reader:
    """One source: reads its counters, and gives the interval since its previous reading."""

    source: ClassVar[SampleSource]

    def __init__(self, device_id: int | None = None) -> None:
        self.device_id = device_id
        self.previous: tuple[int, Any] | None = None

    def read(self) -> Any:
        raise NotImplementedError

    def interval(self, before: Any, after: Any, seconds: float) -> tuple[dict[str, float], EnergyMethod]:
        raise NotImplementedError

    def sample(self, time_ns: int) -> Sample | None:
        reading = self.read()
        previous, self.previous = self.previous, (time_ns, reading)
        if previous is None or time_ns <= previous[0]:
            return None
        metrics, method = self.interval(previous[1], reading, (time_ns - previous[0]) / 1e9)
        return Sample(self.source.value, self.device_id, previous[0], time_ns, metrics, method.value)


class ProcessReader(_Reader):
    source = SampleSource.PROCESS

    def __init__(self) -> None:
        import psutil

        super().__init__()
        self.process = psutil.Process()

    def read(self) -> tuple[float, int]:
        # the process's CPU clock, in ns (psutil's counts ticks of 10 ms: a session of 4.5 ms read 0% or 200%)
        return time.process_time(), self.process.memory_info().rss

    def interval(self, before: Any, after: Any, seconds: float) -> tuple[dict[str, float], EnergyMethod]:
        return ({M.CPU_PERCENT.value: max(after[0] - before[0], 0.0) / seconds * 100, M.RSS_BYTES.value: after[1]},
                EnergyMethod.UNAVAILABLE)


def rapl_counters(root: Path = RAPL_ROOT) -> list[tuple[Path, int]]:
    """The readable package-level RAPL energy counters (``intel-rapl:N``, not their subzones),
    with each one's wrap-around range in microjoules."""
    found = []
    for zone in sorted(root.glob("intel-rapl:*")) if root.is_dir() else []:
        if zone.name.count(":") != 1:
            continue
        try:
            int((zone / "energy_uj").read_text())
            limit = int((zone / "max_energy_range_uj").read_text())
        except (OSError, ValueError):
            continue
        found.append((zone / "energy_uj", limit))
    return found


class HostReader(_Reader):
    source = SampleSource.HOST

    def __init__(self, rapl_root: Path = RAPL_ROOT) -> None:
        import psutil

        super().__init__()
        self.psutil = psutil
        self.rapl = rapl_counters(rapl_root)
        self.tick_s = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

    def read(self) -> tuple[float, float, int, list[int] | None]:
        times = self.psutil.cpu_times()
        total = sum(times)
        idle = times.idle + getattr(times, "iowait", 0.0)
        energy = None
        if self.rapl:
            try:
                energy = [int(path.read_text()) for path, _ in self.rapl]
            except (OSError, ValueError):
                energy = None
        return total - idle, total, self.psutil.virtual_memory().used, energy

    def interval(self, before: Any, after: Any, seconds: float) -> tuple[dict[str, float], EnergyMethod]:
        total = after[1] - before[1]
        # busy = total - idle is a difference of large float sums: over a short interval it can come
        # out a few ulps below the previous reading, so the share is clamped to what it can be.
        metrics = {M.MEMORY_USED_BYTES.value: after[2]}
        if total >= MIN_HOST_TICKS * self.tick_s:
            busy_share = min(max((after[0] - before[0]) / total, 0.0), 1.0)
            metrics[M.CPU_PERCENT.value] = busy_share * 100
        if before[3] is None or after[3] is None:
            return metrics, EnergyMethod.UNAVAILABLE
        used_uj = sum((now - then) % limit for now, then, (_, limit) in zip(after[3], before[3], self.rapl))
        metrics[M.ENERGY_J.value] = used_uj / 1e6
        metrics[M.POWER_W.value] = used_uj / 1e6 / seconds
        return metrics, EnergyMethod.COUNTER


class GpuReader(_Reader):
    source = SampleSource.GPU

    def __init__(self, pynvml: Any, handle: Any, device_id: int) -> None:
        super().__init__(device_id)
        self.nvml, self.handle = pynvml, handle
        self.has_counter = self._call(pynvml.nvmlDeviceGetTotalEnergyConsumption) is not None

    def _call(self, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return function(self.handle, *args)
        except self.nvml.NVMLError:
            return None

    def read(self) -> tuple[Any, ...]:
        nvml = self.nvml
        utilization = self._call(nvml.nvmlDeviceGetUtilizationRates)
        memory = self._call(nvml.nvmlDeviceGetMemoryInfo)
        power_mw = self._call(nvml.nvmlDeviceGetPowerUsage)
        clock = self._call(nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM)
        energy_mj = self._call(nvml.nvmlDeviceGetTotalEnergyConsumption) if self.has_counter else None
        return (None if utilization is None else utilization.gpu, None if memory is None else memory.used,
                None if power_mw is None else power_mw / 1e3, clock, energy_mj)

    def interval(self, before: Any, after: Any, seconds: float) -> tuple[dict[str, float], EnergyMethod]:
        metrics: dict[str, float] = {}
        for metric, value in zip((M.UTILIZATION_PERCENT, M.MEMORY_USED_BYTES, M.POWER_W, M.SM_CLOCK_MHZ), after):
            if value is not None:
                metrics[metric.value] = value
        if before[4] is not None and after[4] is not None:
            metrics[M.ENERGY_J.value] = max(after[4] - before[4], 0) / 1e3
            return metrics, EnergyMethod.COUNTER
        if before[2] is not None and after[2] is not None:
            metrics[M.ENERGY_J.value] = (before[2] + after[2]) / 2 * seconds
            return metrics, EnergyMethod.POLLED
        return metrics, EnergyMethod.UNAVAILABLE


def visible_gpus(pynvml: Any) -> list[tuple[int, Any]]:
    """``(device_id, handle)`` of the GPUs this process sees: those ``CUDA_VISIBLE_DEVICES``
    names (by index or UUID), numbered as CUDA numbers them; all of them when it is unset."""
    count = pynvml.nvmlDeviceGetCount()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(enumerate(handles))
    chosen: list[tuple[int, Any]] = []
    uuids = None
    for entry in (part.strip() for part in visible.split(",")):
        if not entry:
            break
        if entry.isdigit():
            index = int(entry)
            if index >= count:
                break  # CUDA stops at the first invalid entry
            chosen.append((len(chosen), handles[index]))
            continue
        if uuids is None:
            uuids = [str(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
        match = [h for uuid, h in zip(uuids, handles) if uuid.startswith(entry)]
        if len(match) != 1:
            break
        chosen.append((len(chosen), match[0]))
    return chosen


def gpu_readers() -> tuple[list[GpuReader], str | None]:
    """Readers for the visible NVIDIA GPUs, or none and why."""
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # no driver: NVMLError_LibraryNotFound, DriverNotLoaded...
        return [], f"NVML is not available ({exc})"
    try:
        return [GpuReader(pynvml, handle, device) for device, handle in visible_gpus(pynvml)], None
    except Exception as exc:
        return [], f"NVML could not list the GPUs ({exc})"


class SystemTracer(Tracer):
    """Samples the process, the host and the GPUs on a thread of its own."""

    name: ClassVar[str] = "system"
    level: ClassVar[Level] = Level.SYSTEM
    interprets_in_child = True
    """Its samples travel in the window (:attr:`xsp.record.window.Window.samples`)."""

    def __init__(self, interval_s: float | None = None) -> None:
        self.interval_s = interval_s if interval_s is not None else 1.0 / sampling_hz()
        self._readers: list[_Reader] = []
        self._recording: Recording | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._gpu_note: str | None = None
        self._rapl = False
        self._readings = 0
        self._reading_ns = 0
        self._failures = 0
        self._gc_start_ns: int | None = None
        self._gc_process = 0
        self._gc_pauses = 0
        self._gc_dropped = 0
        self._gc_own = 0
        self._gc_own_ns = 0

    def available(self) -> str | None:
        try:
            import psutil  # noqa: F401
        except ImportError:
            return "psutil is not installed (pip install psutil)"
        return None

    def start(self, recording: Recording) -> None:
        host = HostReader()
        gpus, self._gpu_note = gpu_readers()
        self._rapl = bool(host.rapl)
        self._readers = [ProcessReader(), host, *gpus]
        self._recording = recording
        self.sample()  # the first reading: each interval runs from the one before
        recording.samplers.append(self.sample)
        self._stopping.clear()
        self._thread = start_thread(self._run, "xsp-system")
        self._gc_process = os.getpid()
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # the collector holds the GIL while it runs: no other collection starts in between
        try:
            if os.getpid() != self._gc_process:  # a forked child (a DataLoader worker) takes no windows
                return
            if phase == "start":
                self._gc_start_ns = now_ns()
                return
            start_ns, self._gc_start_ns = self._gc_start_ns, None
            recording = self._recording
            if start_ns is None or recording is None:
                return
            if on_own_thread():  # xsp's work (its imports, its windows): counted, not the program's
                self._gc_own += 1
                self._gc_own_ns += now_ns() - start_ns
                return
            if len(recording.samples) >= MAX_GC_PAUSES:
                self._gc_dropped += 1
                recording.dropped[DROPPED_GC] += 1
                return
            recording.samples.append(GcPause(threading.get_native_id(), start_ns, now_ns(), info["generation"],
                                             info["collected"], info["uncollectable"]))
            self._gc_pauses += 1
        except Exception:  # a callback that raises is printed by the collector: count it instead
            self._gc_dropped += 1

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            try:
                self.sample()
            except Exception:
                self._failures += 1

    def sample(self) -> None:
        """Read every source now and record the intervals since the previous reading."""
        recording = self._recording
        if recording is None:
            return
        with self._lock:
            began = time.thread_time_ns()
            at = now_ns()
            for reader in self._readers:
                found = reader.sample(at)
                if found is not None:
                    recording.samples.append(found)
            self._readings += 1
            self._reading_ns += time.thread_time_ns() - began  # CPU time: waits for the GIL excluded

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)
        recording = self._recording
        if recording is not None:
            if self.sample in recording.samplers:
                recording.samplers.remove(self.sample)
            try:
                self.sample()  # up to the end of the session
            except Exception:
                self._failures += 1
        self._recording = None

    def metadata(self) -> dict[str, Any]:
        gpus = [reader for reader in self._readers if isinstance(reader, GpuReader)]
        return {
            "interval_s": self.interval_s,
            "sources": [reader.source.value if reader.device_id is None else f"gpu{reader.device_id}"
                        for reader in self._readers],
            "gpu": self._gpu_note or "sampled",
            "gpu_energy": [EnergyMethod.COUNTER.value if r.has_counter else EnergyMethod.POLLED.value for r in gpus],
            "cpu_energy": EnergyMethod.COUNTER.value if self._rapl else EnergyMethod.UNAVAILABLE.value,
            "readings": self._readings,
            "reading_cost_us": round(self._reading_ns / self._readings / 1e3, 1) if self._readings else None,
            "failed_readings": self._failures,
            "gc_collections": self._gc_pauses,
            "gc_collections_dropped": self._gc_dropped,
            "gc_collections_by_xsp": self._gc_own,
            "gc_ms_by_xsp": round(self._gc_own_ns / 1e6, 3),
        }

    def collect(self, window: Window) -> pd.DataFrame:
        samples = [item for item in window.samples if isinstance(item, Sample)]
        pauses = [item for item in window.samples if isinstance(item, GcPause)]
        frames = [frame for frame in (sample_rows(samples), gc_rows(pauses)) if len(frame)]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
