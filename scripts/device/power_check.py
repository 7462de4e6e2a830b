"""Proof on a real GPU that wmtp.measure.power measures what it says (docs/design.md, "Power and energy").

Opens the meter, records ~3 s of idle with the sampler on, then runs bf16 8192³ matmuls for known
durations, each load in its own energy window. For every window it reports the counter's energy, the
integral of the sampled instant power over the same span, their ratio, the sampling rate, and the
ranges of clocks and temperature; it writes everything (samples included) to OUT/power_check.json.

Run on the GPU machine from the repo root, with OUT naming the output directory:

    PYTHONPATH=src PYTHONUNBUFFERED=1 python3 scripts/device/power_check.py --out $OUT

Exit status 0 when every check passed, 1 when one failed, 2 when no GPU could be metered.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from wmtp.measure import power

log = logging.getLogger("power_check")

Load = Callable[[float], dict[str, Any]]


def matmul_load(n: int = 8192, batch: int = 20) -> Load:
    """A load that keeps the GPU busy with bf16 n³ matmuls for a given time (synchronised at the end)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    for _ in range(3):  # cuBLAS handle and heuristics, outside any window
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()

    def run(duration_s: float) -> dict[str, Any]:
        torch.cuda.synchronize()
        t0 = time.monotonic()
        done = 0
        while time.monotonic() - t0 < duration_s:
            for _ in range(batch):
                torch.matmul(a, b, out=c)
            torch.cuda.synchronize()
            done += batch
        elapsed = time.monotonic() - t0
        return {"matmuls": done, "elapsed_s": elapsed, "tflop_s": 2 * n**3 * done / elapsed / 1e12}

    return run


def nvml_call_ms(meter: power.PowerMeter, repeats: int = 20) -> dict[str, float]:
    """Median latency of the queries the sampler makes (diagnoses a slow sampler)."""
    nvml, handle = meter._nvml, meter._handle  # diagnostics only: the script peeks at the meter's handle
    calls = {
        "field_power_instant": lambda: nvml.nvmlDeviceGetFieldValues(handle, [power._NVML_FI_DEV_POWER_INSTANT]),
        "power_usage": lambda: nvml.nvmlDeviceGetPowerUsage(handle),
        "energy_counter": lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle),
        "clock_sm": lambda: nvml.nvmlDeviceGetClockInfo(handle, power._NVML_CLOCK_SM),
        "temperature": lambda: nvml.nvmlDeviceGetTemperature(handle, power._NVML_TEMPERATURE_GPU),
        "utilization": lambda: nvml.nvmlDeviceGetUtilizationRates(handle),
    }
    out: dict[str, float] = {}
    for name, fn in calls.items():
        times = []
        try:
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1000.0)
        except Exception as err:
            log.warning("nvml call %s failed: %s", name, err)
            continue
        out[name] = statistics.median(times)
    return out


def _range(rows: list[dict[str, Any]], key: str) -> list[float] | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return [min(vals), max(vals)] if vals else None


def describe(meter: power.PowerMeter, w: power.EnergyWindow, kind: str, nominal_s: float) -> dict[str, Any]:
    rows = meter.samples(w)
    watts = [r["power_w"] for r in rows if r["power_w"] is not None]
    sampled = meter.sampled_energy_j(w)
    ratio = sampled / w.energy_j if sampled is not None and w.energy_j else None
    return {
        **w.to_dict(),
        "kind": kind,
        "nominal_s": nominal_s,
        "sampled_energy_j": sampled,
        "ratio_sampled_over_counter": ratio,
        "n_samples": len(rows),
        "samples_per_s": len(rows) / w.duration_s if w.duration_s > 0 else None,
        "sample_gap_ms_max": max(((b["t_s"] - a["t_s"]) * 1000.0 for a, b in itertools.pairwise(rows)), default=None),
        "power_w_sampled_mean": statistics.fmean(watts) if watts else None,
        "power_w_sampled_range": _range(rows, "power_w"),
        "power_sources": sorted({r["power_source"] for r in rows if r["power_source"]}),
        "sm_clock_mhz_range": _range(rows, "sm_clock_mhz"),
        "mem_clock_mhz_range": _range(rows, "mem_clock_mhz"),
        "temperature_c_range": _range(rows, "temperature_c"),
        "gpu_util_pct_range": _range(rows, "gpu_util_pct"),
    }


def run_check(
    meter: power.PowerMeter,
    load: Load,
    *,
    idle_s: float,
    loads_s: list[float],
    rest_s: float,
    hz: float,
    check_min_s: float,
) -> dict[str, Any]:
    windows: list[dict[str, Any]] = []
    threads_before = {t.ident for t in threading.enumerate()}
    time.sleep(rest_s)
    with meter.sampling(hz=hz):
        meter.begin_window("idle")
        time.sleep(idle_s)
        w = meter.end_window("idle")
        time.sleep(1.5 / hz)  # let the sampler pass the window's end, so its edge is interpolated
        windows.append(describe(meter, w, "idle", idle_s))
        for seconds in loads_s:
            time.sleep(rest_s)
            name = f"load_{seconds:g}s"
            meter.begin_window(name)
            work = load(seconds)  # synchronised before it returns
            w = meter.end_window(name)
            time.sleep(1.5 / hz)  # let the sampler pass the window's end, so its edge is interpolated
            windows.append({**describe(meter, w, "load", seconds), "work": work})
    leftover = [t.name for t in threading.enumerate() if t.ident not in threads_before]

    idle = windows[0]
    loaded = [w for w in windows if w["kind"] == "load"]
    longest = max(loaded, key=lambda w: w["nominal_s"])
    limit = meter.info()["power_limit_w"]
    checks: dict[str, dict[str, Any]] = {}

    def check(name: str, ok: bool, detail: str) -> None:
        checks[name] = {"ok": bool(ok), "detail": detail}

    for w in windows:
        ok = w["valid"] and w["energy_j"] is not None and w["energy_j"] > 0
        check(f"{w['name']}: counter energy", ok, f"{w['energy_j']} J, flag {w['flag']}")
        rate = w["samples_per_s"] or 0.0
        check(f"{w['name']}: samples/s >= {0.8 * hz:g}", rate >= 0.8 * hz, f"{rate:.2f}/s")
        if w["kind"] == "load" and w["nominal_s"] >= check_min_s:
            r = w["ratio_sampled_over_counter"]
            check(
                f"{w['name']}: sampled/counter within 10 %",
                r is not None and abs(r - 1) <= 0.10,
                f"ratio {r}",
            )
        sm, mem, temp = w["sm_clock_mhz_range"], w["mem_clock_mhz_range"], w["temperature_c_range"]
        check(
            f"{w['name']}: clocks sane",
            bool(sm and mem and 0 < sm[0] <= sm[1] <= 3000 and mem[0] > 0),
            f"sm {sm} MHz, mem {mem} MHz",
        )
        check(f"{w['name']}: temperature sane", bool(temp and 5 <= temp[0] <= temp[1] <= 100), f"{temp} C")
    check(
        "load above idle",
        (longest["power_w"] or 0) > 1.5 * (idle["power_w"] or float("inf")),
        f"idle {idle['power_w']} W, {longest['name']} {longest['power_w']} W",
    )
    if limit:
        check(
            "load within power limit",
            (longest["power_w"] or 0) <= 1.05 * limit,
            f"{longest['power_w']} W vs limit {limit} W",
        )
    check("sampler thread gone after the block", not leftover, f"left: {leftover}")
    sources = sorted({s for w in windows for s in w["power_sources"]})
    check("power timeline from the instant field", sources == [power.POWER_INSTANT], f"sources {sources}")
    return {
        "windows": windows,
        "summary": {
            "idle_power_w": idle["power_w"],
            "load_power_w": longest["power_w"],
            "ratios": {w["name"]: w["ratio_sampled_over_counter"] for w in loaded},
            "samples_per_s": {w["name"]: w["samples_per_s"] for w in windows},
        },
        "checks": checks,
        "ok": all(c["ok"] for c in checks.values()),
    }


def _versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    for dist in ("nvidia-ml-py", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main(argv: list[str] | None = None, *, nvml: Any = None, load: Load | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for power_check.json")
    ap.add_argument("--idle", type=float, default=3.0, help="idle window, s")
    ap.add_argument("--loads", default="1,2,4,8", help="load windows, s, comma-separated")
    ap.add_argument("--rest", type=float, default=2.0, help="rest before the idle window and each load, s")
    ap.add_argument("--hz", type=float, default=10.0, help="sampler rate")
    ap.add_argument("--check-min-s", type=float, default=2.0, help="check the ratio on loads this long or longer")
    ap.add_argument("--gpu", type=int, default=None, help="NVML index (default: from CUDA_VISIBLE_DEVICES)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)

    started = datetime.now(UTC).isoformat()
    result: dict[str, Any] = {"script": "scripts/device/power_check.py", "started": started, **_versions()}
    meter = power.open_meter(args.gpu, nvml=nvml)
    result["info_start"] = meter.info()
    log.info("meter: %s", json.dumps(result["info_start"]))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "power_check.json"
    if not meter.available:
        result["ok"] = False
        path.write_text(json.dumps(result, indent=1))
        log.error("no GPU to meter: %s", meter.reason)
        return 2
    with meter:
        result["nvml_call_ms"] = nvml_call_ms(meter)
        log.info("nvml call latency, ms (median): %s", result["nvml_call_ms"])
        if load is None:
            load = matmul_load()
        loads_s = [float(x) for x in args.loads.split(",") if x.strip()]
        result.update(
            run_check(
                meter,
                load,
                idle_s=args.idle,
                loads_s=loads_s,
                rest_s=args.rest,
                hz=args.hz,
                check_min_s=args.check_min_s,
            )
        )
        result["info_end"] = meter.info()
        result["samples"] = meter.samples()
    result["finished"] = datetime.now(UTC).isoformat()
    path.write_text(json.dumps(result, indent=1))

    for w in result["windows"]:
        log.info(
            "%-9s %5.2f s  counter %8.1f J (%6.1f W)  sampled %8.1f J  ratio %s  %5.2f samples/s  "
            "sm %s MHz  mem %s MHz  temp %s C%s",
            w["name"],
            w["duration_s"],
            w["energy_j"] or float("nan"),
            w["power_w"] or float("nan"),
            w["sampled_energy_j"] or float("nan"),
            "n/a" if w["ratio_sampled_over_counter"] is None else f"{w['ratio_sampled_over_counter']:.3f}",
            w["samples_per_s"] or 0.0,
            w["sm_clock_mhz_range"],
            w["mem_clock_mhz_range"],
            w["temperature_c_range"],
            f"  {w['work']['tflop_s']:.0f} TFLOP/s" if "work" in w else "",
        )
    for name, c in result["checks"].items():
        log.info("%s  %s: %s", "PASS" if c["ok"] else "FAIL", name, c["detail"])
    log.info("info at end: %s", json.dumps(result["info_end"]))
    log.info("overall: %s; wrote %s", "PASS" if result["ok"] else "FAIL", path)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
