"""GPU power and energy through NVML (docs/design.md, "Power and energy").

Energy of record is the delta of ``nvmlDeviceGetTotalEnergyConsumption`` (mJ) over an explicit
window (Zeus-style ``begin_window`` / ``end_window``); a counter that goes backwards makes the window
invalid, never partially right. A background sampler records the power timeline from the field
``NVML_FI_DEV_POWER_INSTANT`` (``nvmlDeviceGetPowerUsage`` is a ~1 s trailing average and is only the
fallback, marked in the ``power_source`` column), plus clocks, temperature and utilisation.

``pynvml`` (the nvidia-ml-py package) is imported lazily, so this module imports on a CPU box without
it; where NVML cannot be used the meter says so (``status == "unavailable"``) and every energy is
``None``, never zero. A fake NVML module can be passed to :func:`open_meter` as ``nvml=``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

MEASURED = "measured"
RELATIVE_ONLY = "relative-only"
UNAVAILABLE = "unavailable"

#: Columns of a sampler row, in order.
SAMPLE_COLUMNS = (
    "t_s",
    "wall_time_s",
    "power_w",
    "power_source",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "temperature_c",
    "gpu_util_pct",
    "mem_util_pct",
)
#: ``power_source`` values: the instant field, or the ~1 s trailing average (do not integrate it).
POWER_INSTANT = "instant"
POWER_AVERAGE = "average"

#: The energy counter advances about ten times a second: shorter windows carry up to ~10 % error.
SHORT_WINDOW_S = 1.0

# NVML constants, with their values as fallbacks for older bindings (and small fakes).
_NVML_SUCCESS = 0
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_DRIVER_NOT_LOADED = 9
_NVML_ERROR_LIBRARY_NOT_FOUND = 12
_NVML_FI_DEV_POWER_INSTANT = 186
_NVML_CLOCK_SM = 1
_NVML_CLOCK_MEM = 2
_NVML_TEMPERATURE_GPU = 0
_VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


# --------------------------------------------------------------------------------------------------
# Pure helpers


def energy_delta_j(start_mj: float | None, end_mj: float | None) -> float | None:
    """Energy in joules between two readings of the mJ counter; None if either is missing or on reset."""
    if start_mj is None or end_mj is None:
        return None
    if end_mj < start_mj:
        return None
    return (end_mj - start_mj) / 1000.0


def integrate_power_j(
    t_s: Sequence[float],
    power_w: Sequence[float | None],
    *,
    start_s: float | None = None,
    end_s: float | None = None,
) -> float | None:
    """Trapezoid integral of a power timeline in joules.

    Points whose power is None or NaN are dropped. With ``start_s``/``end_s`` the timeline is clipped to
    that interval, interpolating linearly at the edges (an edge outside the sampled span is clamped to
    it). Returns None with fewer than two usable points.
    """
    if len(t_s) != len(power_w):
        raise ValueError(f"power: t_s and power_w differ in length ({len(t_s)} vs {len(power_w)})")
    pts = sorted((float(t), float(p)) for t, p in zip(t_s, power_w, strict=True) if p is not None and not math.isnan(p))
    if len(pts) < 2:
        return None
    lo = pts[0][0] if start_s is None else max(start_s, pts[0][0])
    hi = pts[-1][0] if end_s is None else min(end_s, pts[-1][0])
    if hi <= lo:
        return None

    def at(t: float) -> float:
        for (t0, p0), (t1, p1) in itertools.pairwise(pts):
            if t0 <= t <= t1:
                return p0 if t1 == t0 else p0 + (p1 - p0) * (t - t0) / (t1 - t0)
        return pts[0][1] if t < pts[0][0] else pts[-1][1]

    clipped = [(lo, at(lo))] + [(t, p) for t, p in pts if lo < t < hi] + [(hi, at(hi))]
    return sum((t1 - t0) * (p0 + p1) / 2.0 for (t0, p0), (t1, p1) in itertools.pairwise(clipped))


def gpu_selector(cuda_visible_devices: str | None) -> int | str:
    """Which NVML device ``CUDA_VISIBLE_DEVICES`` points at: an index, or a UUID (``GPU-…``/``MIG-…``).

    Only the first entry counts; unset, empty or unparsable means index 0. Note that NVML numbers
    devices in PCI order while CUDA's default order is fastest-first: on mixed machines set
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or use UUIDs.
    """
    if not cuda_visible_devices or not cuda_visible_devices.strip():
        return 0
    first = cuda_visible_devices.split(",")[0].strip()
    if first.startswith(("GPU-", "MIG-")):
        return first
    try:
        index = int(first)
    except ValueError:
        log.warning(
            "power: CUDA_VISIBLE_DEVICES=%r: first entry is no index or UUID; using GPU 0",
            cuda_visible_devices,
        )
        return 0
    if index < 0:
        log.warning("power: CUDA_VISIBLE_DEVICES=%r hides every GPU; measuring GPU 0", cuda_visible_devices)
        return 0
    return index


# --------------------------------------------------------------------------------------------------
# Windows


@dataclass(frozen=True)
class EnergyWindow:
    """One measurement window. ``energy_j`` is None whenever it is not known exactly (reset, no counter)."""

    name: str
    start_s: float
    end_s: float
    duration_s: float
    energy_j: float | None
    valid: bool
    flag: str | None

    @property
    def power_w(self) -> float | None:
        """Mean power over the window (energy / window time)."""
        if self.energy_j is None or self.duration_s <= 0:
            return None
        return self.energy_j / self.duration_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "duration_s": self.duration_s,
            "energy_j": self.energy_j,
            "power_w": self.power_w,
            "valid": self.valid,
            "flag": self.flag,
        }


@dataclass
class _Open:
    start_s: float
    start_mj: int | None
    flag: str | None


# --------------------------------------------------------------------------------------------------
# Meter


class PowerMeter:
    """NVML energy windows and a background power sampler for one GPU. Build it with :func:`open_meter`."""

    def __init__(
        self,
        nvml: ModuleType | Any | None,
        handle: Any,
        gpu_index: int | None,
        status: str,
        reason: str | None,
    ) -> None:
        self._nvml = nvml
        self._handle = handle
        self.gpu_index = gpu_index
        self.status = status
        self.reason = reason
        self._windows: dict[str, _Open] = {}
        self._lock = threading.Lock()
        self._rows: list[dict[str, Any]] = []
        self._instant_ok: bool | None = None  # unknown until the first sample
        self._thread: threading.Thread | None = None
        self._closed = False
        self.sampler_error: str | None = None

    # ----- identity

    @property
    def available(self) -> bool:
        return self.status != UNAVAILABLE

    def __repr__(self) -> str:
        return f"PowerMeter(gpu_index={self.gpu_index}, status={self.status!r}, reason={self.reason!r})"

    def _const(self, name: str, default: int) -> int:
        return getattr(self._nvml, name, default)

    def _try(self, fn_name: str, *args: Any) -> Any:
        """Call an NVML device query; None when it fails (logged at debug level)."""
        try:
            return getattr(self._nvml, fn_name)(self._handle, *args)
        except Exception as err:  # NVMLError or a binding without this function
            log.debug("power: %s failed: %s", fn_name, err)
            return None

    def info(self) -> dict[str, Any]:
        """GPU identity and state now, for a cell's manifest (at start and at end)."""
        out: dict[str, Any] = {
            "gpu_name": None,
            "gpu_index": self.gpu_index,
            "uuid": None,
            "driver": None,
            "power_limit_w": None,
            "sm_clock_mhz": None,
            "mem_clock_mhz": None,
            "temperature_c": None,
            "status": self.status,
            "reason": self.reason,
        }
        if not self.available:
            return out
        out["gpu_name"] = _text(self._try("nvmlDeviceGetName"))
        out["uuid"] = _text(self._try("nvmlDeviceGetUUID"))
        try:
            out["driver"] = _text(self._nvml.nvmlSystemGetDriverVersion())
        except Exception as err:
            log.debug("power: nvmlSystemGetDriverVersion failed: %s", err)
        limit_mw = self._try("nvmlDeviceGetEnforcedPowerLimit")
        out["power_limit_w"] = None if limit_mw is None else limit_mw / 1000.0
        out["sm_clock_mhz"] = self._try("nvmlDeviceGetClockInfo", self._const("NVML_CLOCK_SM", _NVML_CLOCK_SM))
        out["mem_clock_mhz"] = self._try("nvmlDeviceGetClockInfo", self._const("NVML_CLOCK_MEM", _NVML_CLOCK_MEM))
        out["temperature_c"] = self._try(
            "nvmlDeviceGetTemperature", self._const("NVML_TEMPERATURE_GPU", _NVML_TEMPERATURE_GPU)
        )
        return out

    # ----- energy windows

    def _read_energy_mj(self) -> tuple[int | None, str | None]:
        """The energy counter in mJ, or None and why."""
        if not self.available:
            return None, self.reason
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)), None
        except Exception as err:
            if getattr(err, "value", None) == self._const("NVML_ERROR_NOT_SUPPORTED", _NVML_ERROR_NOT_SUPPORTED):
                return None, "energy counter not supported on this GPU (NVML NOT_SUPPORTED)"
            return None, f"energy counter unreadable: {err}"

    def begin_window(self, name: str) -> None:
        """Open a window named ``name``; windows may nest or overlap, names must be unique while open."""
        with self._lock:
            if name in self._windows:
                raise ValueError(f"power: window {name!r} is already open; end it before beginning it again")
        start_mj, why = self._read_energy_mj()
        start_s = time.monotonic()
        with self._lock:
            self._windows[name] = _Open(start_s=start_s, start_mj=start_mj, flag=why)

    def end_window(self, name: str) -> EnergyWindow:
        """Close window ``name`` and return its energy (None with a flag when it is not known exactly)."""
        with self._lock:
            opened = self._windows.pop(name, None)
            if opened is None:
                raise ValueError(
                    f"power: no open window named {name!r} (open: {sorted(self._windows) or 'none'}); "
                    "call begin_window first"
                )
        end_mj, why = self._read_energy_mj()
        end_s = time.monotonic()
        duration = end_s - opened.start_s
        energy: float | None = None
        flag = opened.flag or why
        if flag is None:
            energy = energy_delta_j(opened.start_mj, end_mj)
            if energy is None:
                flag = f"counter reset (energy counter went from {opened.start_mj} to {end_mj} mJ)"
                log.warning("power: window %r invalid: %s", name, flag)
        valid = energy is not None
        if valid and self.status == RELATIVE_ONLY:
            flag = "relative-only: comparable between arms on this GPU, not absolute"
        elif valid and duration < SHORT_WINDOW_S:
            flag = f"short window ({duration:.2f} s < {SHORT_WINDOW_S:.0f} s): up to ~10 % counter quantisation"
        return EnergyWindow(
            name=name,
            start_s=opened.start_s,
            end_s=end_s,
            duration_s=duration,
            energy_j=energy,
            valid=valid,
            flag=flag,
        )

    @property
    def open_windows(self) -> list[str]:
        with self._lock:
            return sorted(self._windows)

    # ----- sampler

    def _read_power_w(self) -> tuple[float | None, str | None]:
        if self._instant_ok is not False:
            field = self._const("NVML_FI_DEV_POWER_INSTANT", _NVML_FI_DEV_POWER_INSTANT)
            try:
                value = self._nvml.nvmlDeviceGetFieldValues(self._handle, [field])[0]
                if value.nvmlReturn != self._const("NVML_SUCCESS", _NVML_SUCCESS):
                    raise RuntimeError(f"field {field} returned NVML error {value.nvmlReturn}")
                mw = getattr(value.value, _VALUE_FIELDS.get(int(value.valueType), "uiVal"))
                self._instant_ok = True
                return float(mw) / 1000.0, POWER_INSTANT
            except Exception as err:
                if self._instant_ok is None:
                    log.warning(
                        "power: NVML_FI_DEV_POWER_INSTANT unreadable (%s); falling back to "
                        "nvmlDeviceGetPowerUsage, a ~1 s trailing average",
                        err,
                    )
                    self._instant_ok = False
                else:
                    log.debug("power: instant power read failed: %s", err)
                    return None, POWER_INSTANT
        mw = self._try("nvmlDeviceGetPowerUsage")
        return (None if mw is None else float(mw) / 1000.0), POWER_AVERAGE

    def _sample(self) -> dict[str, Any]:
        t_s = time.monotonic()
        wall = time.time()
        power_w, source = self._read_power_w()
        util = self._try("nvmlDeviceGetUtilizationRates")
        return {
            "t_s": t_s,
            "wall_time_s": wall,
            "power_w": power_w,
            "power_source": source,
            "sm_clock_mhz": self._try("nvmlDeviceGetClockInfo", self._const("NVML_CLOCK_SM", _NVML_CLOCK_SM)),
            "mem_clock_mhz": self._try("nvmlDeviceGetClockInfo", self._const("NVML_CLOCK_MEM", _NVML_CLOCK_MEM)),
            "temperature_c": self._try(
                "nvmlDeviceGetTemperature", self._const("NVML_TEMPERATURE_GPU", _NVML_TEMPERATURE_GPU)
            ),
            "gpu_util_pct": getattr(util, "gpu", None),
            "mem_util_pct": getattr(util, "memory", None),
        }

    def _run_sampler(self, period_s: float, stop: threading.Event) -> None:
        try:
            next_t = time.monotonic()
            while True:
                row = self._sample()
                with self._lock:
                    self._rows.append(row)
                if stop.is_set():
                    return  # that was the closing sample
                next_t += period_s
                now = time.monotonic()
                if next_t < now:  # fell behind (a slow query): skip, don't burst
                    next_t = now
                stop.wait(next_t - now)
        except Exception as err:  # keep the with-block's own exception, if any, in charge
            self.sampler_error = f"{type(err).__name__}: {err}"
            log.exception("power: sampler stopped early")

    @contextlib.contextmanager
    def sampling(self, hz: float = 10.0) -> Iterator[PowerMeter]:
        """Record samples at ``hz`` in a daemon thread for the duration of the with-block.

        The thread is stopped and joined when the block exits, also on an exception; one sample is
        taken at the start and one at the end, so a window inside the block is covered edge to edge.
        On an unavailable meter this does nothing.
        """
        if hz <= 0:
            raise ValueError(f"power: sampling hz must be > 0 (got {hz})")
        if not self.available:
            yield self
            return
        if self._thread is not None:
            raise RuntimeError("power: this meter is already sampling; nest windows, not samplers")
        stop = threading.Event()
        self.sampler_error = None
        thread = threading.Thread(
            target=self._run_sampler,
            args=(1.0 / hz, stop),
            name=f"wmtp-power-gpu{self.gpu_index}",
            daemon=True,
        )
        self._thread = thread
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self._thread = None
            if self.sampler_error:
                log.warning("power: sampler ended with an error: %s", self.sampler_error)

    def samples(self, window: EnergyWindow | None = None) -> list[dict[str, Any]]:
        """Rows recorded so far (all sampling blocks), or only those inside ``window``'s time span."""
        with self._lock:
            rows = [dict(r) for r in self._rows]
        if window is not None:
            rows = [r for r in rows if window.start_s <= r["t_s"] <= window.end_s]
        return rows

    def samples_frame(self, window: EnergyWindow | None = None):  # -> pandas.DataFrame
        """:meth:`samples` as a pandas DataFrame (pandas is imported here, not at module import)."""
        import pandas as pd

        return pd.DataFrame(self.samples(window), columns=list(SAMPLE_COLUMNS))

    def clear_samples(self) -> None:
        with self._lock:
            self._rows.clear()

    def sampled_energy_j(self, window: EnergyWindow) -> float | None:
        """Integral of the sampled power over ``window`` (edges interpolated). A cross-check, not the
        energy of record; None when the timeline is the trailing average or too sparse."""
        rows = self.samples()
        if any(r["power_source"] == POWER_AVERAGE for r in rows):
            return None
        return integrate_power_j(
            [r["t_s"] for r in rows], [r["power_w"] for r in rows], start_s=window.start_s, end_s=window.end_s
        )

    # ----- lifetime

    def close(self) -> None:
        """Shut NVML down (once). Sampling must have ended."""
        if self._closed or self._nvml is None:
            self._closed = True
            return
        self._closed = True
        try:
            self._nvml.nvmlShutdown()
        except Exception as err:
            log.debug("power: nvmlShutdown failed: %s", err)

    def __enter__(self) -> PowerMeter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _unavailable(reason: str, gpu_index: int | None = None) -> PowerMeter:
    log.warning("power: %s", reason)
    return PowerMeter(None, None, gpu_index, UNAVAILABLE, reason)


def open_meter(gpu_index: int | None = None, *, nvml: ModuleType | Any | None = None) -> PowerMeter:
    """Open a meter on one GPU.

    ``gpu_index`` None picks the first entry of ``CUDA_VISIBLE_DEVICES`` (an index, or a ``GPU-``/
    ``MIG-`` UUID looked up by UUID), else GPU 0. ``nvml`` replaces the ``pynvml`` module (tests).
    Never raises for a missing library, driver or GPU: the meter is then ``unavailable`` with a reason.
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return _unavailable("not measured: nvidia-ml-py (pynvml) is not installed", gpu_index)
    try:
        nvml.nvmlInit()
    except Exception as err:
        code = getattr(err, "value", None)
        if code == getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", _NVML_ERROR_LIBRARY_NOT_FOUND):
            return _unavailable("not measured: no NVML on this machine (libnvidia-ml not found)", gpu_index)
        if code == getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", _NVML_ERROR_DRIVER_NOT_LOADED):
            return _unavailable("not measured: NVIDIA driver not loaded", gpu_index)
        return _unavailable(f"not measured: NVML init failed: {err}", gpu_index)

    selector: int | str = gpu_index if gpu_index is not None else gpu_selector(os.environ.get("CUDA_VISIBLE_DEVICES"))
    try:
        if isinstance(selector, str):
            handle = nvml.nvmlDeviceGetHandleByUUID(selector.encode())
            try:
                index: int | None = int(nvml.nvmlDeviceGetIndex(handle))
            except Exception:
                index = None  # MIG handles have no device index
        else:
            handle = nvml.nvmlDeviceGetHandleByIndex(selector)
            index = selector
    except Exception as err:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
        what = f"UUID {selector}" if isinstance(selector, str) else f"index {selector}"
        return _unavailable(f"not measured: no GPU at NVML {what} ({err})", gpu_index)

    try:
        name = _text(nvml.nvmlDeviceGetName(handle)) or ""
    except Exception:
        name = ""
    if "GB10" in name:
        meter = PowerMeter(
            nvml,
            handle,
            index,
            RELATIVE_ONLY,
            f"relative-only: {name} (DGX Spark) energy is comparable between arms, not absolute",
        )
    else:
        meter = PowerMeter(nvml, handle, index, MEASURED, None)
    log.info("power: metering %s (NVML index %s): %s", name or "GPU", index, meter.status)
    return meter
