"""wmtp.measure.power: pure helpers, the real "no NVML here" path, and edge cases driven through a small fake NVML."""

from __future__ import annotations

import ctypes.util
import importlib.util
import json
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from wmtp.measure import power

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------
# A small fake of the pynvml module: one constant power that tests can change, an energy counter that
# integrates it exactly, and switches for the failure modes.


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"fake NVML error {value}")
        self.value = value


class FakeNVML:
    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NOT_FOUND = 6
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_FI_DEV_POWER_INSTANT = 186

    def __init__(self, name="NVIDIA H200", n_gpus=2, watts=100.0, energy=True, instant=True, init_error=None):
        self.name, self.n_gpus, self.watts = name, n_gpus, watts
        self.energy, self.instant, self.init_error = energy, instant, init_error
        self._acc_mj, self._t = 5_000_000.0, time.monotonic()
        self.handles: list[object] = []
        self.shutdowns = 0

    # knobs for the tests
    def set_power(self, watts: float) -> None:
        now = time.monotonic()
        self._acc_mj += self.watts * (now - self._t) * 1000.0
        self._t, self.watts = now, watts

    def reset_counter(self) -> None:
        self._acc_mj, self._t = 0.0, time.monotonic()

    # the NVML surface wmtp.measure.power uses
    def nvmlInit(self):
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < self.n_gpus:
            raise FakeNVMLError(self.NVML_ERROR_NOT_FOUND)
        self.handles.append(("index", index))
        return ("index", index)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        assert isinstance(uuid, bytes), "pynvml's nvmlDeviceGetHandleByUUID takes bytes"
        if uuid != b"GPU-bbbb":
            raise FakeNVMLError(self.NVML_ERROR_NOT_FOUND)
        self.handles.append(("uuid", uuid))
        return ("index", 1)

    def nvmlDeviceGetIndex(self, handle):
        return handle[1]

    def nvmlDeviceGetName(self, handle):
        return self.name

    def nvmlDeviceGetUUID(self, handle):
        return f"GPU-fake-{handle[1]}"

    def nvmlSystemGetDriverVersion(self):
        return "580.159.04"

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        if "GB10" in self.name:
            raise FakeNVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return 700_000

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return {1: 1980, 2: 3201}[clock]

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 41

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=100 if self.watts > 200 else 0, memory=30)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if not self.energy:
            raise FakeNVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return int(self._acc_mj + self.watts * (time.monotonic() - self._t) * 1000.0)

    def nvmlDeviceGetFieldValues(self, handle, field_ids):
        assert field_ids == [self.NVML_FI_DEV_POWER_INSTANT]
        ret = 0 if self.instant else self.NVML_ERROR_NOT_SUPPORTED
        return [SimpleNamespace(nvmlReturn=ret, valueType=1, value=SimpleNamespace(uiVal=int(self.watts * 1000)))]

    def nvmlDeviceGetPowerUsage(self, handle):
        return int(self.watts * 1000)


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("wmtp-power")]


# --------------------------------------------------------------------------------------------------
# Pure helpers


def test_energy_delta_j():
    assert power.energy_delta_j(1_000, 3_500) == 2.5
    assert power.energy_delta_j(7, 7) == 0.0
    assert power.energy_delta_j(10_000, 9_999) is None  # reset: never a partial value
    assert power.energy_delta_j(None, 5) is None
    assert power.energy_delta_j(5, None) is None


def test_integrate_power_j_trapezoid():
    assert power.integrate_power_j([0, 1, 2], [100, 100, 100]) == pytest.approx(200.0)
    assert power.integrate_power_j([0, 2], [0, 100]) == pytest.approx(100.0)  # a ramp
    assert power.integrate_power_j([2, 0, 1], [100, 100, 100]) == pytest.approx(200.0)  # unsorted input
    assert power.integrate_power_j([0, 1, 2], [100, None, 100]) == pytest.approx(200.0)  # gaps dropped
    assert power.integrate_power_j([0, 1, 2], [100, math.nan, 300]) == pytest.approx(400.0)
    assert power.integrate_power_j([0], [100]) is None
    assert power.integrate_power_j([], []) is None
    with pytest.raises(ValueError, match="differ in length"):
        power.integrate_power_j([0, 1], [1])


def test_integrate_power_j_clips_with_interpolated_edges():
    # ramp 0 → 100 W over 0..2 s: power(t) = 50 t; ∫_0.5^1.5 = 25 (1.5² − 0.5²) = 50 J
    assert power.integrate_power_j([0, 1, 2], [0, 50, 100], start_s=0.5, end_s=1.5) == pytest.approx(50.0)
    # an edge outside the sampled span is clamped to it
    assert power.integrate_power_j([0, 1], [10, 10], start_s=-5, end_s=0.5) == pytest.approx(5.0)
    assert power.integrate_power_j([0, 1], [10, 10], start_s=3, end_s=4) is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, 0),
        ("", 0),
        ("3", 3),
        (" 2 ,0", 2),
        ("GPU-bbbb,1", "GPU-bbbb"),
        ("MIG-x", "MIG-x"),
        ("nonsense", 0),
        ("-1", 0),
    ],
)
def test_gpu_selector(value, expected):
    assert power.gpu_selector(value) == expected


# --------------------------------------------------------------------------------------------------
# The real library on this CPU box: pynvml is installed, the driver is not


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="this machine has NVML")
def test_real_open_meter_without_nvml_is_unavailable():
    meter = power.open_meter()
    assert not meter.available
    assert meter.status == "unavailable"
    assert meter.reason.startswith("not measured:")
    if importlib.util.find_spec("pynvml") is not None:
        assert "no NVML" in meter.reason
    info = meter.info()
    assert info["status"] == "unavailable" and info["gpu_name"] is None and info["reason"] == meter.reason
    meter.begin_window("decode")
    w = meter.end_window("decode")
    assert w.energy_j is None and not w.valid and w.flag == meter.reason and w.power_w is None
    with meter.sampling(hz=50):
        assert not sampler_threads()
        time.sleep(0.05)
    assert meter.samples() == []
    assert meter.samples_frame().empty
    meter.close()


# --------------------------------------------------------------------------------------------------
# Device selection and status


def test_cuda_visible_devices_picks_the_index(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    fake = FakeNVML()
    meter = power.open_meter(nvml=fake)
    assert meter.gpu_index == 1 and fake.handles == [("index", 1)]
    assert meter.info()["gpu_index"] == 1 and meter.info()["uuid"] == "GPU-fake-1"


def test_cuda_visible_devices_uuid_is_looked_up(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    fake = FakeNVML()
    meter = power.open_meter(nvml=fake)
    assert fake.handles == [("uuid", b"GPU-bbbb")] and meter.gpu_index == 1 and meter.status == "measured"


def test_explicit_index_wins_and_default_is_zero(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert power.open_meter(0, nvml=FakeNVML()).gpu_index == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert power.open_meter(nvml=FakeNVML()).gpu_index == 0


def test_missing_gpu_or_library_is_unavailable(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNVML(n_gpus=1)
    meter = power.open_meter(5, nvml=fake)
    assert meter.status == "unavailable" and "no GPU at NVML index 5" in meter.reason
    assert fake.shutdowns == 1  # init was balanced
    meter = power.open_meter(nvml=FakeNVML(init_error=FakeNVML.NVML_ERROR_LIBRARY_NOT_FOUND))
    assert (
        meter.status == "unavailable"
        and meter.reason == "not measured: no NVML on this machine (libnvidia-ml not found)"
    )
    meter.begin_window("w")
    assert meter.end_window("w").energy_j is None


def test_measured_info_and_window_energy():
    fake = FakeNVML(watts=400.0)
    with power.open_meter(0, nvml=fake) as meter:
        info = meter.info()
        assert info == {
            "gpu_name": "NVIDIA H200",
            "gpu_index": 0,
            "uuid": "GPU-fake-0",
            "driver": "580.159.04",
            "power_limit_w": 700.0,
            "sm_clock_mhz": 1980,
            "mem_clock_mhz": 3201,
            "temperature_c": 41,
            "status": "measured",
            "reason": None,
        }
        meter.begin_window("w")
        time.sleep(0.2)
        w = meter.end_window("w")
    assert fake.shutdowns == 1
    assert w.valid and w.energy_j == pytest.approx(400.0 * w.duration_s, rel=0.05)
    assert w.flag.startswith("short window")  # 0.2 s: the counter's quantisation is flagged
    assert w.end_s - w.start_s == w.duration_s
    with pytest.raises(AttributeError):
        w.energy_j = 1.0  # frozen


def test_gb10_is_relative_only():
    meter = power.open_meter(0, nvml=FakeNVML(name="NVIDIA GB10"))
    assert meter.status == "relative-only" and meter.available
    assert "GB10" in meter.reason
    assert meter.info()["power_limit_w"] is None
    meter.begin_window("w")
    w = meter.end_window("w")
    assert w.valid and w.energy_j is not None and w.flag.startswith("relative-only")


# --------------------------------------------------------------------------------------------------
# Windows: resets, unsupported counter, nesting, misuse


def test_counter_reset_invalidates_the_window():
    fake = FakeNVML(watts=300.0)
    meter = power.open_meter(0, nvml=fake)
    meter.begin_window("w")
    fake.reset_counter()
    w = meter.end_window("w")
    assert w.energy_j is None and not w.valid and w.flag.startswith("counter reset")


def test_energy_counter_not_supported():
    meter = power.open_meter(0, nvml=FakeNVML(energy=False))
    assert meter.status == "measured"
    meter.begin_window("w")
    w = meter.end_window("w")
    assert w.energy_j is None and not w.valid and "not supported" in w.flag


def test_windows_nest_and_overlap():
    fake = FakeNVML(watts=100.0)
    meter = power.open_meter(0, nvml=fake)
    meter.begin_window("outer")
    meter.begin_window("a")
    time.sleep(0.05)
    meter.begin_window("b")
    a = meter.end_window("a")
    time.sleep(0.05)
    assert meter.open_windows == ["b", "outer"]
    b = meter.end_window("b")
    outer = meter.end_window("outer")
    assert outer.start_s < a.start_s < b.start_s < a.end_s < b.end_s < outer.end_s
    assert outer.energy_j >= a.energy_j and outer.energy_j >= b.energy_j


def test_window_misuse_raises_clearly():
    meter = power.open_meter(0, nvml=FakeNVML())
    with pytest.raises(ValueError, match="no open window named 'decode'"):
        meter.end_window("decode")
    meter.begin_window("decode")
    with pytest.raises(ValueError, match="already open"):
        meter.begin_window("decode")
    meter.end_window("decode")


# --------------------------------------------------------------------------------------------------
# Sampler


def test_sampler_rate_rows_and_thread_lifetime():
    fake = FakeNVML(watts=150.0)
    meter = power.open_meter(0, nvml=fake)
    t0 = time.monotonic()
    with meter.sampling(hz=50.0):
        assert len(sampler_threads()) == 1 and sampler_threads()[0].daemon
        time.sleep(0.6)
    elapsed = time.monotonic() - t0
    assert not sampler_threads()
    rows = meter.samples()
    assert 0.8 * 50 * elapsed <= len(rows) <= 50 * elapsed + 3
    assert list(rows[0]) == list(power.SAMPLE_COLUMNS)
    assert {r["power_source"] for r in rows} == {"instant"}
    assert all(r["power_w"] == 150.0 and r["sm_clock_mhz"] == 1980 and r["gpu_util_pct"] == 0 for r in rows)
    ts = [r["t_s"] for r in rows]
    assert ts == sorted(ts)
    frame = meter.samples_frame()
    assert list(frame.columns) == list(power.SAMPLE_COLUMNS) and len(frame) == len(rows)


def test_sampler_stops_when_the_block_raises():
    meter = power.open_meter(0, nvml=FakeNVML())
    with pytest.raises(RuntimeError, match="boom"), meter.sampling(hz=20.0):
        assert sampler_threads()
        raise RuntimeError("boom")
    assert not sampler_threads()
    n = len(meter.samples())
    time.sleep(0.1)
    assert len(meter.samples()) == n  # nothing records after the block


def test_sampler_falls_back_to_average_power_and_says_so():
    meter = power.open_meter(0, nvml=FakeNVML(instant=False, watts=220.0))
    with meter.sampling(hz=50.0):
        time.sleep(0.1)
    rows = meter.samples()
    assert rows and {r["power_source"] for r in rows} == {"average"} and rows[0]["power_w"] == 220.0
    meter.begin_window("w")
    w = meter.end_window("w")
    assert meter.sampled_energy_j(w) is None  # the trailing average is never integrated


def test_sampled_energy_tracks_the_counter():
    fake = FakeNVML(watts=100.0)
    meter = power.open_meter(0, nvml=fake)
    with meter.sampling(hz=50.0):
        time.sleep(0.1)
        meter.begin_window("load")
        fake.set_power(600.0)
        time.sleep(0.5)
        fake.set_power(100.0)
        w = meter.end_window("load")
        time.sleep(0.05)
    inside = meter.samples(w)
    assert inside and all(w.start_s <= r["t_s"] <= w.end_s for r in inside)
    assert meter.sampled_energy_j(w) == pytest.approx(w.energy_j, rel=0.1)


def test_second_sampler_on_one_meter_is_refused():
    meter = power.open_meter(0, nvml=FakeNVML())
    with meter.sampling(hz=20.0), pytest.raises(RuntimeError, match="already sampling"), meter.sampling():
        pass
    assert not sampler_threads()


# --------------------------------------------------------------------------------------------------
# The device script's logic, with the fake and a load that only changes the fake's power


def test_power_check_script_logic(tmp_path):
    spec = importlib.util.spec_from_file_location("power_check", REPO / "scripts/device/power_check.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    fake = FakeNVML(watts=120.0)

    def load(seconds):
        fake.set_power(690.0)
        time.sleep(seconds)
        fake.set_power(120.0)
        return {"matmuls": 0, "elapsed_s": seconds, "tflop_s": 0.0}

    argv = [
        "--out",
        str(tmp_path),
        "--idle",
        "0.3",
        "--loads",
        "0.3,0.5",
        "--rest",
        "0.05",
        "--hz",
        "50",
        "--check-min-s",
        "0",
    ]
    assert script.main(argv, nvml=fake, load=load) == 0
    result = json.loads((tmp_path / "power_check.json").read_text())
    assert result["ok"] and [w["name"] for w in result["windows"]] == ["idle", "load_0.3s", "load_0.5s"]
    assert result["summary"]["idle_power_w"] == pytest.approx(120.0, rel=0.1)
    assert result["summary"]["load_power_w"] == pytest.approx(690.0, rel=0.1)
    assert all(abs(r - 1) <= 0.1 for r in result["summary"]["ratios"].values())
    assert result["samples"] and result["info_end"]["status"] == "measured"
    assert not sampler_threads()
