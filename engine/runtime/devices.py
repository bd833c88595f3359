"""Worker devices (the ledger that counts their memory is ledger.py's).

    device = open_device("auto", None, local_rank, local_world_size)   # CudaDevice or LedgerDevice
    device.ledger.track_module(model, optimizer)        # parameters, gradients, optimizer state, fp32 masters,
                                                        # the blocks' shared inputs (masks, rotary tables)
    with device.ledger.saved_activations():             # live saved activations
        loss = model(x).sum(); loss.backward()
    device.stats()                                      # the ledger's keys on both kinds, plus the GPU's own

On the CPU a "device" is the worker process: its memory is the engine's ledger,
counted against the configured capacity (`[device] memory`, 512 MiB by default). It is a
simulation and says so (`simulated: True`). On CUDA the same ledger runs beside the
allocator's own figures and NVML's (a CudaProbe), and the capacity is the GPU's memory
unless `[device] memory` caps it.
"""

from __future__ import annotations

import os
import time

import psutil
import torch

from engine.runtime.ledger import CATEGORIES, MemoryLedger, tensor_bytes  # noqa: F401  (re-exported)
from engine.runtime.refusal import Refused

SIMULATED_CAPACITY_BYTES = 512 * 2**20   # device.memory = "auto" on the CPU: the simulated device's size
OS_SAMPLE_S = 0.5   # the OS's and the driver's gauges (RSS, CPU, NVML) are read at most this often (stats())


class LedgerDevice:
    """The CPU as a device: a worker process, its memory counted by the ledger.

    `probe` (optional) adds a GPU's own figures to `stats()`: CudaDevice gives a CudaProbe; tests give a
    stub with the same methods, so the CUDA telemetry path runs on the CPU."""

    kind = "cpu"
    simulated = True

    def __init__(self, capacity_bytes: int | None = None, probe=None):
        self.torch_device = torch.device("cpu")
        self.probe = probe
        if capacity_bytes is None:   # device.memory = "auto": the GPU's own memory, or the simulated default
            capacity_bytes = probe.total_bytes() if probe is not None else SIMULATED_CAPACITY_BYTES
        self.ledger = MemoryLedger(capacity_bytes)
        self.note = ""   # which device and why (open_device sets it; run_start carries it)
        self.rank_names: list[str] = []   # every rank's device name, by rank (gathered at start: worker.meet)
        self._proc = psutil.Process(os.getpid())
        self._proc.cpu_percent(None)  # the first call only starts the measurement
        self._gauges: dict | None = None   # stats(): the OS's and the driver's figures, and when they were read
        self._gauges_at = 0.0

    @property
    def name(self) -> str:
        if self.probe is not None:
            return self.probe.name()
        return "cpu (simulated device: memory from the engine's ledger)"

    def stats(self) -> dict:
        """The ledger's figures now, the GPU allocator's now, and the gauges the OS and the driver keep (RSS, CPU,
        NVML's used memory and utilisation) as read at most OS_SAMPLE_S ago: reading those costs a system call
        or a driver call each, and a short step would pay them every step."""
        now = time.monotonic()
        if self._gauges is None or now - self._gauges_at >= OS_SAMPLE_S:
            self._gauges = {"rss_bytes": self._proc.memory_info().rss, "cpu_percent": self._proc.cpu_percent(None),
                            **(self.probe.gauges() if self.probe is not None else {})}
            self._gauges_at = now
        out = {"kind": self.kind, "simulated": self.simulated, **self.ledger.breakdown(), **self._gauges}
        if self.probe is not None:
            out.update(self.probe.figures())
        return out


class CudaProbe:
    """One CUDA GPU's own figures: torch's caching allocator, and NVML where the driver has it."""

    def __init__(self, index: int):
        torch.cuda.set_device(index)
        self.index = index
        self._nvml = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:   # no NVML (driver without it, container): allocator figures only
            self._nvml = None

    def name(self) -> str:
        return torch.cuda.get_device_name(self.index)

    def total_bytes(self) -> int:
        return int(torch.cuda.get_device_properties(self.index).total_memory)

    def figures(self) -> dict:
        """GPU_FIELDS (engine/runtime/control.py) the allocator keeps: now, reserved, peak (read every step)."""
        return {"allocated_bytes": torch.cuda.memory_allocated(self.index),
                "allocator_peak_bytes": torch.cuda.max_memory_allocated(self.index),
                "reserved_bytes": torch.cuda.memory_reserved(self.index)}

    def gauges(self) -> dict:
        """GPU_FIELDS NVML keeps: used, total, utilisation (driver calls: read at most every OS_SAMPLE_S)."""
        if self._nvml is None:
            return {}
        import pynvml
        mem = pynvml.nvmlDeviceGetMemoryInfo(self._nvml)
        util = pynvml.nvmlDeviceGetUtilizationRates(self._nvml)
        return {"nvml_used_bytes": int(mem.used), "nvml_total_bytes": int(mem.total), "gpu_util_percent": int(util.gpu)}


class CudaDevice(LedgerDevice):
    """One CUDA GPU per worker: the ledger plus the allocator's figures and NVML's."""

    kind = "cuda"
    simulated = False

    def __init__(self, capacity_bytes: int | None, index: int):
        super().__init__(capacity_bytes, probe=CudaProbe(index))
        self.index = index
        self.torch_device = torch.device("cuda", index)
        self.ledger.device_type = "cuda"   # what autograd saves on the host is not this GPU's (ledger.py)


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_usable(local_world_size: int) -> bool:
    return cuda_count() >= local_world_size


def choose_device(kind: str, local_world_size: int) -> tuple[str, str]:
    """(`cuda` or `cpu`, why): `kind` is the config's device.kind; auto picks CUDA when every worker on
    this host has a GPU of its own. Raises Refused for `cuda` without enough GPUs."""
    count = cuda_count()
    plural = "device is" if count == 1 else "devices are"
    if kind == "cuda" and count < local_world_size:
        if count == 0:
            raise Refused(f'device.kind = "cuda" but no CUDA device is visible on this host '
                               f'(torch {torch.__version__}): set device.kind = "cpu" or "auto"')
        raise Refused(f'device.kind = "cuda" but {count} CUDA {plural} visible for {local_world_size} '
                           f"workers on this host (one GPU per worker): set parallel.world_size to at most "
                           f'{count} per host, or device.kind = "cpu"')
    if kind == "cpu":
        return "cpu", 'cpu: device.kind = "cpu" (simulated devices: memory from the engine\'s ledger)'
    if count >= local_world_size:
        return "cuda", f"cuda: one GPU per worker ({count} visible for {local_world_size} workers on this host)"
    if count == 0:
        return "cpu", ('cpu: device.kind = "auto" and no CUDA device is visible '
                       "(simulated devices: memory from the engine's ledger)")
    return "cpu", (f'cpu: device.kind = "auto" but {count} CUDA {plural} visible for {local_world_size} '
                   f"workers on this host, so every worker trains on the CPU (simulated devices); "
                   f"parallel.world_size = {count} per host would train on the GPUs")


def open_device(kind: str, capacity_bytes: int | None, local_rank: int, local_world_size: int) -> LedgerDevice:
    """`kind` is the config's device.kind; `capacity_bytes` None (device.memory = "auto") is the GPU's own
    memory on CUDA and SIMULATED_CAPACITY_BYTES on the CPU."""
    chosen, note = choose_device(kind, local_world_size)
    device = CudaDevice(capacity_bytes, local_rank) if chosen == "cuda" else LedgerDevice(capacity_bytes)
    device.note = note
    return device
