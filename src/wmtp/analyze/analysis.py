"""Derived quantities of the Spark study (docs/design.md, "Formulas"). Pure functions, no I/O.

Three layers, each usable alone:

* scalar formulas (``decode_tok_s``, ``cycle_ms``, ``draft_tax``, ``cost_side_wedge`` ...);
* seeded percentile bootstrap over repeats (``bootstrap_ci``, ``speedup_ci``, ``speedup_change_ci``),
  returning :class:`CI` ``(point, lo, hi)``;
* small-frame functions over the tidy tables of ``results/<study>/tidy/`` (``speedup_table``,
  ``draft_tax_table``, ``cost_side_table`` ...), which group by :data:`SERIES_KEYS` and the rung.

The point statistic over repeats is the median by default, as in ``rungs.parquet`` (whose
``decode_tok_s``, ``ttft_s`` and ``cycle_ms`` come from the median request of a rung), so a speedup
from :func:`speedup_table` equals the ratio of the two arms' ``rungs.decode_tok_s``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal, NamedTuple

import numpy as np
import pandas as pd

Statistic = Literal["median", "mean"]

#: One line in a chart: everything that identifies a server configuration, and the workload, except the rung.
SERIES_KEYS: tuple[str, ...] = ("model", "engine", "arm", "k", "sink", "window", "concurrency", "workload")
#: What a drafting arm is compared with the no-draft arm on (plus the rung).
MATCH_KEYS: tuple[str, ...] = ("model", "engine", "concurrency", "workload")
BASE_ARM = "none"
NATIVE_ARM = "mtp"
WINDOWED_ARMS: tuple[str, ...] = ("wmtp", "wmtp-ring")

DEFAULT_N_BOOT = 10_000
DEFAULT_LEVEL = 0.95
DEFAULT_SEED = 0


# --------------------------------------------------------------------------------------------------
# Scalar formulas
# --------------------------------------------------------------------------------------------------


def decode_tok_s(completion_tokens: int, e2e_s: float, ttft_s: float) -> float:
    """Decode rate excluding the first token, which belongs to prefill."""
    return decode_rate(completion_tokens, e2e_s - ttft_s)


def decode_rate(completion_tokens: int, decode_s: float) -> float:
    """Tokens after the first over the decode window (first token to last), on whichever clock timed it."""
    if completion_tokens < 2 or not decode_s > 0:
        return math.nan
    return (completion_tokens - 1) / decode_s


def prefill_tok_s(prompt_tokens: int, ttft_s: float) -> float:
    return prompt_tokens / ttft_s if ttft_s > 0 else math.nan


def tok_per_verify(d_accepted: float, d_drafts: float) -> float:
    """Tokens emitted per verify cycle: 1 (the target's own) + accepted drafts per cycle."""
    if d_drafts <= 0:
        return math.nan
    return 1.0 + d_accepted / d_drafts


def acceptance_rate(d_accepted: float, d_draft_tokens: float) -> float:
    return d_accepted / d_draft_tokens if d_draft_tokens > 0 else math.nan


def position_rate(d_accepted_at_position: float, d_drafts: float) -> float:
    return d_accepted_at_position / d_drafts if d_drafts > 0 else math.nan


def cycle_ms(tokens_per_verify: float, decode_tokens_per_s: float) -> float:
    """Wall time of one verify cycle (k draft forwards + one target forward); 1000/tok_s without a draft.

    The one home of this formula; :func:`cycle_ms_of` applies it element by element.
    """
    if not decode_tokens_per_s > 0:
        return math.nan
    return tokens_per_verify * 1000.0 / decode_tokens_per_s


def cycle_ms_of(tokens_per_verify: object, decode_tokens_per_s: object) -> np.ndarray:
    """:func:`cycle_ms` over arrays (or an array and a number), as numpy broadcasts them."""
    return np.vectorize(cycle_ms, otypes=[float])(tokens_per_verify, decode_tokens_per_s)


def request_cycle_ms_of(
    request_tok_per_verify: object, rung_tok_per_verify: object, decode_tokens_per_s: object
) -> np.ndarray:
    """Each request's verify cycle (ms): :func:`cycle_ms` at the request's own tokens per verify where its cell
    counted them (NaN where it did not), else at its rung's pooled count.

    Only a request alone on its server owns the counters' increments between two snapshots. At higher concurrency
    its tokens still came at about the rung's count per cycle; at 1 a drafting request's cycle would read as one
    token's time, below the cycle's byte floor whenever drafts are accepted.
    """
    own = np.asarray(request_tok_per_verify, dtype=float)
    return cycle_ms_of(np.where(np.isnan(own), rung_tok_per_verify, own), decode_tokens_per_s)


def decode_tok_s_from_cycle_ms(cycle_milliseconds: float, tokens_per_verify: float = 1.0) -> float:
    """The inverse of :func:`cycle_ms`: the decode rate a cycle time and tokens per cycle imply."""
    if not cycle_milliseconds or math.isnan(cycle_milliseconds):
        return math.nan
    return tokens_per_verify * 1000.0 / cycle_milliseconds


def drafts_from_tok_per_verify(d_accepted: float, tokens_per_verify: float) -> float:
    """Number of verify cycles (Δdrafts) implied by the accepted total and tokens per cycle."""
    if tokens_per_verify <= 1.0 or math.isnan(tokens_per_verify):
        return math.nan
    return d_accepted / (tokens_per_verify - 1.0)


class AcceptanceFromPositions(NamedTuple):
    tok_per_verify: float
    acceptance_rate: float
    position_rates: tuple[float, ...]


def acceptance_from_positions(
    accepted_per_position: Sequence[float], d_drafts: float, k: int | None = None
) -> AcceptanceFromPositions:
    """tokPerVerify, acceptance rate and per-position rates from per-position accepted counts.

    Every cycle drafts ``k`` tokens (``k`` defaults to the number of positions), so
    Δdraft_tokens = k · Δdrafts.
    """
    k = len(accepted_per_position) if k is None else k
    accepted = float(sum(accepted_per_position))
    return AcceptanceFromPositions(
        tok_per_verify=tok_per_verify(accepted, d_drafts),
        acceptance_rate=acceptance_rate(accepted, k * d_drafts),
        position_rates=tuple(position_rate(a, d_drafts) for a in accepted_per_position),
    )


def tok_per_j(generated_tokens: float, energy_j: float | None) -> float:
    """Generated tokens per joule of the decode window (NaN without an energy reading)."""
    if energy_j is None or not energy_j > 0:
        return math.nan
    return generated_tokens / energy_j


def power_w(energy_j: float | None, window_s: float) -> float:
    """Mean power over a window: energy / window time."""
    if energy_j is None or math.isnan(energy_j) or not window_s > 0:
        return math.nan
    return energy_j / window_s


def relative_change(before: float, after: float) -> float:
    """after / before − 1 (e.g. 0.40 for 14.14 → 19.84 ms)."""
    if not before or math.isnan(before):
        return math.nan
    return after / before - 1.0


def cost_side_ratio(step_nat_ms: float, step_win_ms: float) -> float:
    """The paper's per-decode-step speedup of the windowed draft: step_nat / step_win."""
    if not step_win_ms or math.isnan(step_win_ms):
        return math.nan
    return step_nat_ms / step_win_ms


def cost_side_wedge(step_nat_ms: float, step_win_ms: float) -> float:
    """The paper's Fig. 3 quantity: step_nat / step_win − 1 (0.28–0.44 claimed at 1M)."""
    return cost_side_ratio(step_nat_ms, step_win_ms) - 1.0


def cost_side_wedge_of(step_nat_ms: object, step_win_ms: object) -> np.ndarray:
    """:func:`cost_side_wedge` over arrays (or an array and a number), as numpy broadcasts them."""
    return np.vectorize(cost_side_wedge, otypes=[float])(step_nat_ms, step_win_ms)


@dataclass(frozen=True)
class DraftTax:
    """Draft-tax decomposition between two rungs (docs/design.md, "Draft tax"; the Spark study's "The tax is real").

    ``draft_growth_ms`` = growth of the verify cycle − growth of the plain decode step;
    ``per_step_ms`` = draft_growth_ms / k; ``share`` = per_step_ms / target_growth_ms.
    """

    k: int
    target_from_ms: float
    target_to_ms: float
    cycle_from_ms: float
    cycle_to_ms: float
    target_growth_ms: float
    cycle_growth_ms: float
    draft_growth_ms: float
    per_step_ms: float
    share: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def draft_tax(target_from_ms: float, target_to_ms: float, cycle_from_ms: float, cycle_to_ms: float, k: int) -> DraftTax:
    """Decompose a drafting arm's cycle growth into the target's and the draft's share.

    ``target_*`` are the no-draft arm's cycleMs (one target forward) at the two rungs, ``cycle_*`` the
    drafting arm's full verify cycle. The Spark study: 14.14 → 19.84 and 31.16 → 38.35 at k = 3 give
    ≈ 0.50 ms per draft step and ≈ 8.8 % of the target's growth.
    """
    if k < 1:
        raise ValueError(f"draft_tax: k must be ≥ 1 for a drafting arm (got {k})")
    target_growth = target_to_ms - target_from_ms
    cycle_growth = cycle_to_ms - cycle_from_ms
    draft_growth = cycle_growth - target_growth
    per_step = draft_growth / k
    share = per_step / target_growth if target_growth and not math.isnan(target_growth) else math.nan
    return DraftTax(
        k=k,
        target_from_ms=target_from_ms,
        target_to_ms=target_to_ms,
        cycle_from_ms=cycle_from_ms,
        cycle_to_ms=cycle_to_ms,
        target_growth_ms=target_growth,
        cycle_growth_ms=cycle_growth,
        draft_growth_ms=draft_growth,
        per_step_ms=per_step,
        share=share,
    )


# --------------------------------------------------------------------------------------------------
# Bootstrap over repeats
# --------------------------------------------------------------------------------------------------


class CI(NamedTuple):
    """A point estimate and its percentile bootstrap interval."""

    point: float
    lo: float
    hi: float


def finite_values(values: Sequence[float] | np.ndarray | pd.Series) -> np.ndarray:
    arr = np.asarray(pd.to_numeric(pd.Series(values, dtype="object"), errors="coerce"), dtype=float)
    return arr[np.isfinite(arr)]


def _stat_fn(statistic: Statistic) -> Callable[..., np.ndarray]:
    if statistic == "median":
        return np.median
    if statistic == "mean":
        return np.mean
    raise ValueError(f"statistic must be 'median' or 'mean' (got {statistic!r})")


def bootstrap_replicates(
    samples: Sequence[Sequence[float] | np.ndarray | pd.Series],
    fn: Callable[..., np.ndarray],
    *,
    statistic: Statistic = "median",
    n_boot: int = DEFAULT_N_BOOT,
    seed: int = DEFAULT_SEED,
) -> tuple[float, np.ndarray]:
    """Point value and bootstrap replicates of ``fn(stat(s0), stat(s1), ...)``.

    Each sample is resampled with replacement independently (repeats of different arms or rungs are
    independent requests). ``fn`` receives one array of ``n_boot`` statistics per sample and must be
    vectorised. NaN values are dropped; an empty sample gives a NaN point and NaN replicates.
    """
    stat = _stat_fn(statistic)
    rng = np.random.default_rng(seed)
    clean = [finite_values(s) for s in samples]
    if any(len(c) == 0 for c in clean):
        return math.nan, np.full(n_boot, math.nan)
    points = [np.asarray(stat(c)) for c in clean]
    reps = [stat(c[rng.integers(0, len(c), size=(n_boot, len(c)))], axis=1) for c in clean]
    with np.errstate(divide="ignore", invalid="ignore"):
        point = float(fn(*points))
        rep = np.asarray(fn(*reps), dtype=float)
    return point, rep


def percentile_ci(point: float, replicates: np.ndarray, level: float = DEFAULT_LEVEL) -> CI:
    """Percentile interval of bootstrap replicates around ``point``."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1) (got {level})")
    finite = replicates[np.isfinite(replicates)]
    if math.isnan(point) or len(finite) == 0:
        return CI(point, math.nan, math.nan)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(finite, [alpha, 1.0 - alpha])
    return CI(point, float(lo), float(hi))


def bootstrap_se(replicates: np.ndarray) -> float:
    """Standard deviation of the replicates: the bootstrap's "± σ"."""
    finite = replicates[np.isfinite(replicates)]
    return float(np.std(finite, ddof=1)) if len(finite) > 1 else math.nan


def bootstrap_ci(
    values: Sequence[float] | np.ndarray | pd.Series,
    *,
    statistic: Statistic = "median",
    n_boot: int = DEFAULT_N_BOOT,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
) -> CI:
    """Statistic of the repeats with a seeded percentile bootstrap interval."""
    point, reps = bootstrap_replicates([values], lambda a: a, statistic=statistic, n_boot=n_boot, seed=seed)
    return percentile_ci(point, reps, level)


def _ratio(arm: np.ndarray, base: np.ndarray) -> np.ndarray:
    return arm / base


def _ratio_change(base_a: np.ndarray, arm_a: np.ndarray, base_b: np.ndarray, arm_b: np.ndarray) -> np.ndarray:
    return arm_b / base_b - arm_a / base_a


def speedup_ci(
    base_tok_s: Sequence[float] | np.ndarray | pd.Series,
    arm_tok_s: Sequence[float] | np.ndarray | pd.Series,
    *,
    statistic: Statistic = "median",
    n_boot: int = DEFAULT_N_BOOT,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
) -> CI:
    """Speedup stat(arm)/stat(base) of per-repeat decode tok/s, both arms resampled."""
    point, reps = bootstrap_replicates([arm_tok_s, base_tok_s], _ratio, statistic=statistic, n_boot=n_boot, seed=seed)
    return percentile_ci(point, reps, level)


def speedup_change_ci(
    base_from: Sequence[float] | np.ndarray | pd.Series,
    arm_from: Sequence[float] | np.ndarray | pd.Series,
    base_to: Sequence[float] | np.ndarray | pd.Series,
    arm_to: Sequence[float] | np.ndarray | pd.Series,
    *,
    statistic: Statistic = "median",
    n_boot: int = DEFAULT_N_BOOT,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
) -> CI:
    """Change of the speedup from one rung to another (the Spark study: +0.080 ± 0.032 from 2K to 131K)."""
    point, reps = bootstrap_replicates(
        [base_from, arm_from, base_to, arm_to], _ratio_change, statistic=statistic, n_boot=n_boot, seed=seed
    )
    return percentile_ci(point, reps, level)


# --------------------------------------------------------------------------------------------------
# Frames over the tidy tables
# --------------------------------------------------------------------------------------------------


def _keys(frame: pd.DataFrame, keys: Sequence[str]) -> list[str]:
    return [k for k in keys if k in frame.columns]


def _key_tuple(value: object) -> tuple[object, ...]:
    return value if isinstance(value, tuple) else (value,)


def _na_to_none(value: object) -> object:
    try:
        return None if pd.isna(value) else value  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return value


def group_rows(frame: pd.DataFrame, keys: Sequence[str]) -> list[tuple[dict[str, object], pd.DataFrame]]:
    cols = _keys(frame, keys)
    if frame.empty:
        return []
    out = []
    for key, group in frame.groupby(cols, dropna=False, sort=True):
        out.append((dict(zip(cols, (_na_to_none(v) for v in _key_tuple(key)), strict=True)), group))
    return out


def select_rows(frame: pd.DataFrame, where: dict[str, object]) -> pd.DataFrame:
    mask = pd.Series(True, index=frame.index)
    for col, val in where.items():
        if col not in frame.columns:
            continue
        mask &= frame[col].isna() if _is_na(val) else frame[col] == val
    return frame[mask]


def _is_na(value: object) -> bool:
    if value is None:
        return True
    try:
        return bool(pd.isna(value))  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False


def _is_drafting(arm: object) -> bool:
    return arm is not None and arm != BASE_ARM


def _k_of(row: dict[str, object]) -> int:
    k = row.get("k")
    return int(k) if k is not None and not pd.isna(k) else 0  # type: ignore[call-overload]


def rungs_of(frame: pd.DataFrame) -> list[int]:
    """Sorted distinct rungs of a tidy frame."""
    if frame.empty or "rung" not in frame.columns:
        return []
    return sorted(int(r) for r in frame["rung"].dropna().unique())


def repeat_table(
    requests: pd.DataFrame,
    column: str,
    *,
    statistic: Statistic = "median",
    n_boot: int = DEFAULT_N_BOOT,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
) -> pd.DataFrame:
    """Per series and rung: the statistic of ``column`` over repeats with CI, se, n, min and max.

    Used for decode tok/s, TTFT, prefill tok/s and tok/J. Rows with no finite value are left out.
    """
    rows = []
    for key, group in group_rows(requests, (*SERIES_KEYS, "rung")):
        values = finite_values(group[column]) if column in group.columns else np.array([])
        if len(values) == 0:
            continue
        point, reps = bootstrap_replicates([values], lambda a: a, statistic=statistic, n_boot=n_boot, seed=seed)
        ci = percentile_ci(point, reps, level)
        rows.append(
            {
                **key,
                "value": ci.point,
                "lo": ci.lo,
                "hi": ci.hi,
                "se": bootstrap_se(reps),
                "n": len(values),
                "min": float(values.min()),
                "max": float(values.max()),
            }
        )
    return pd.DataFrame(rows)


def decode_table(requests: pd.DataFrame, **kwargs: object) -> pd.DataFrame:
    """Decode tok/s per series and rung with bootstrap CI (see :func:`repeat_table`)."""
    return repeat_table(requests, "decode_tok_s", **kwargs)  # type: ignore[arg-type]


def prefill_table(requests: pd.DataFrame, **kwargs: object) -> pd.DataFrame:
    """TTFT and prefill tok/s per series and rung, each with bootstrap CI."""
    ttft = repeat_table(requests, "ttft_s", **kwargs)  # type: ignore[arg-type]
    rate = repeat_table(requests, "prefill_tok_s", **kwargs)  # type: ignore[arg-type]
    if ttft.empty or rate.empty:
        return pd.DataFrame()
    keys = [*_keys(ttft, SERIES_KEYS), "rung"]
    ttft = ttft.rename(columns={c: f"ttft_s_{c}" if c != "value" else "ttft_s" for c in ttft.columns if c not in keys})
    rate = rate.rename(
        columns={c: f"prefill_tok_s_{c}" if c != "value" else "prefill_tok_s" for c in rate.columns if c not in keys}
    )
    return ttft.merge(rate, on=keys, how="outer")


def _base_and_arms(requests: pd.DataFrame, base_arm: str) -> list[tuple[dict[str, object], pd.DataFrame, pd.DataFrame]]:
    """(series key, arm requests, matching base requests) for every drafting series."""
    out = []
    if requests.empty:
        return out
    for key, group in group_rows(requests, SERIES_KEYS):
        if key.get("arm") == base_arm:
            continue
        base = select_rows(requests, {"arm": base_arm, **{k: key[k] for k in _keys(requests, MATCH_KEYS)}})
        if base.empty:
            continue
        out.append((key, group, base))
    return out


def speedup_table(
    requests: pd.DataFrame,
    *,
    base_arm: str = BASE_ARM,
    statistic: Statistic = "median",
    n_boot: int = DEFAULT_N_BOOT,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
) -> pd.DataFrame:
    """Speedup of every drafting series over the base arm, per rung, with bootstrap CI.

    Matched by model, engine, concurrency and rung; the per-repeat decode tok/s of both arms are
    resampled. Columns: the series keys, rung, speedup, lo, hi, se, n_base, n_arm.
    """
    rows = []
    for key, arm_req, base_req in _base_and_arms(requests, base_arm):
        for rung in rungs_of(arm_req):
            a = finite_values(arm_req.loc[arm_req["rung"] == rung, "decode_tok_s"])
            b = finite_values(base_req.loc[base_req["rung"] == rung, "decode_tok_s"])
            if len(a) == 0 or len(b) == 0:
                continue
            point, reps = bootstrap_replicates([a, b], _ratio, statistic=statistic, n_boot=n_boot, seed=seed)
            ci = percentile_ci(point, reps, level)
            rows.append(
                {
                    **key,
                    "rung": rung,
                    "speedup": ci.point,
                    "lo": ci.lo,
                    "hi": ci.hi,
                    "se": bootstrap_se(reps),
                    "n_base": len(b),
                    "n_arm": len(a),
                }
            )
    return pd.DataFrame(rows)


def _pick_rungs(available: Sequence[int], rung_from: int | None, rung_to: int | None) -> tuple[int, int] | None:
    if len(available) < 2 and (rung_from is None or rung_to is None):
        return None
    lo = available[0] if rung_from is None else rung_from
    hi = available[-1] if rung_to is None else rung_to
    if lo not in available or hi not in available or lo == hi:
        return None
    return lo, hi


def speedup_change_table(
    requests: pd.DataFrame,
    *,
    rung_from: int | None = None,
    rung_to: int | None = None,
    base_arm: str = BASE_ARM,
    statistic: Statistic = "median",
    n_boot: int = DEFAULT_N_BOOT,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
) -> pd.DataFrame:
    """Change of each drafting series' speedup between two rungs (default: its smallest and largest).

    Columns: the series keys, rung_from, rung_to, speedup_from, speedup_to, change, lo, hi, se.
    """
    rows = []
    for key, arm_req, base_req in _base_and_arms(requests, base_arm):
        common = sorted(set(rungs_of(arm_req)) & set(rungs_of(base_req)))
        picked = _pick_rungs(common, rung_from, rung_to)
        if picked is None:
            continue
        r0, r1 = picked

        def tok_s(frame: pd.DataFrame, rung: int) -> np.ndarray:
            return finite_values(frame.loc[frame["rung"] == rung, "decode_tok_s"])

        samples = [tok_s(base_req, r0), tok_s(arm_req, r0), tok_s(base_req, r1), tok_s(arm_req, r1)]
        if any(len(s) == 0 for s in samples):
            continue
        point, reps = bootstrap_replicates(samples, _ratio_change, statistic=statistic, n_boot=n_boot, seed=seed)
        ci = percentile_ci(point, reps, level)
        stat = _stat_fn(statistic)
        rows.append(
            {
                **key,
                "rung_from": r0,
                "rung_to": r1,
                "speedup_from": float(stat(samples[1]) / stat(samples[0])),
                "speedup_to": float(stat(samples[3]) / stat(samples[2])),
                "change": ci.point,
                "lo": ci.lo,
                "hi": ci.hi,
                "se": bootstrap_se(reps),
            }
        )
    return pd.DataFrame(rows)


def _rung_value(rungs: pd.DataFrame, where: dict[str, object], rung: int, column: str) -> float:
    sel = select_rows(rungs, {**where, "rung": rung})
    if sel.empty or column not in sel.columns:
        return math.nan
    value = pd.to_numeric(sel[column], errors="coerce").dropna()
    return float(value.iloc[0]) if len(value) else math.nan


def draft_tax_table(
    rungs: pd.DataFrame,
    requests: pd.DataFrame | None = None,
    *,
    rung_from: int | None = None,
    rung_to: int | None = None,
    base_arm: str = BASE_ARM,
    statistic: Statistic = "median",
    n_boot: int = DEFAULT_N_BOOT,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
) -> pd.DataFrame:
    """The draft-tax decomposition of every drafting series between two rungs.

    From ``rungs.cycle_ms``. With ``requests``, the per-step growth and the share also get bootstrap
    intervals (decode tok/s of both arms at both rungs resampled, tokPerVerify held at the rung's
    counter value, which has no per-repeat spread). Columns: the series keys, rung_from, rung_to and
    the fields of :class:`DraftTax`, plus per_step_lo/hi and share_lo/hi when requests are given.
    """
    rows = []
    for key, group in group_rows(rungs, SERIES_KEYS):
        if not _is_drafting(key.get("arm")) or base_arm == key.get("arm"):
            continue
        match = {k: key[k] for k in _keys(rungs, MATCH_KEYS)}
        base = select_rows(rungs, {"arm": base_arm, **match})
        picked = _pick_rungs(sorted(set(rungs_of(group)) & set(rungs_of(base))), rung_from, rung_to)
        if picked is None:
            continue
        r0, r1 = picked
        k = _k_of(key)
        if k < 1:
            continue
        tax = draft_tax(
            _rung_value(base, {}, r0, "cycle_ms"),
            _rung_value(base, {}, r1, "cycle_ms"),
            _rung_value(group, {}, r0, "cycle_ms"),
            _rung_value(group, {}, r1, "cycle_ms"),
            k,
        )
        row: dict[str, object] = {**key, "rung_from": r0, "rung_to": r1, **tax.as_dict()}
        if requests is not None and not requests.empty:
            tpv0 = _rung_value(group, {}, r0, "tok_per_verify")
            tpv1 = _rung_value(group, {}, r1, "tok_per_verify")
            arm_req = select_rows(requests, key)
            base_req = select_rows(requests, {"arm": base_arm, **match})

            def tok_s(frame: pd.DataFrame, rung: int) -> np.ndarray:
                return finite_values(frame.loc[frame["rung"] == rung, "decode_tok_s"])

            def per_step(
                b0: np.ndarray,
                b1: np.ndarray,
                a0: np.ndarray,
                a1: np.ndarray,
                tpv0: float = tpv0,
                tpv1: float = tpv1,
                k: int = k,
            ) -> np.ndarray:
                return (
                    (cycle_ms_of(tpv1, a1) - cycle_ms_of(tpv0, a0)) - (cycle_ms_of(1.0, b1) - cycle_ms_of(1.0, b0))
                ) / k

            def share(
                b0: np.ndarray,
                b1: np.ndarray,
                a0: np.ndarray,
                a1: np.ndarray,
                tpv0: float = tpv0,
                tpv1: float = tpv1,
                k: int = k,
            ) -> np.ndarray:
                return per_step(b0, b1, a0, a1, tpv0, tpv1, k) / (cycle_ms_of(1.0, b1) - cycle_ms_of(1.0, b0))

            samples = [tok_s(base_req, r0), tok_s(base_req, r1), tok_s(arm_req, r0), tok_s(arm_req, r1)]
            for name, field_name, fn in (("per_step", "per_step_ms", per_step), ("share", "share", share)):
                _, reps = bootstrap_replicates(samples, fn, statistic=statistic, n_boot=n_boot, seed=seed)
                ci = percentile_ci(float(row[field_name]), reps, level)  # type: ignore[arg-type]
                row[f"{name}_lo"], row[f"{name}_hi"] = ci.lo, ci.hi
        rows.append(row)
    return pd.DataFrame(rows)


def acceptance_table(rungs: pd.DataFrame) -> pd.DataFrame:
    """tokPerVerify and acceptance per drafting series and rung, recomputed from the counter deltas.

    Rungs whose counters did not move (Δdrafts = 0) keep NaN rather than a made-up 1.0.
    """
    if rungs.empty:
        return pd.DataFrame()
    drafting = rungs[rungs["arm"] != BASE_ARM].copy()
    if drafting.empty:
        return pd.DataFrame()
    drafting["tok_per_verify"] = [
        tok_per_verify(a, d) for a, d in zip(drafting["d_accepted"], drafting["d_drafts"], strict=True)
    ]
    drafting["acceptance_rate"] = [
        acceptance_rate(a, t) for a, t in zip(drafting["d_accepted"], drafting["d_draft_tokens"], strict=True)
    ]
    cols = [
        *_keys(drafting, SERIES_KEYS),
        "rung",
        "d_drafts",
        "d_draft_tokens",
        "d_accepted",
        "tok_per_verify",
        "acceptance_rate",
    ]
    return drafting[cols].reset_index(drop=True)


def position_table(positions: pd.DataFrame, rungs: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per-position acceptance rate (Δaccepted_pos / Δdrafts) per drafting series and rung.

    With ``rungs`` the rate is recomputed from the rung's Δdrafts; otherwise the tidy ``rate`` is kept.
    """
    if positions.empty:
        return pd.DataFrame()
    out = positions.copy()
    if rungs is not None and not rungs.empty:
        keys = [c for c in ("cell_id", "workload", "rung") if c in out.columns and c in rungs.columns]
        drafts = rungs[[*keys, "d_drafts"]].drop_duplicates(keys)
        out = out.merge(drafts, on=keys, how="left")
        out["rate"] = [position_rate(a, d) for a, d in zip(out["d_accepted_pos"], out["d_drafts"], strict=True)]
    cols = [*_keys(out, SERIES_KEYS), "rung", "position", "d_accepted_pos", "rate"]
    return out[cols].sort_values([*_keys(out, SERIES_KEYS), "rung", "position"]).reset_index(drop=True)


def energy_table(
    rungs: pd.DataFrame,
    requests: pd.DataFrame | None = None,
    *,
    statistic: Statistic = "median",
    n_boot: int = DEFAULT_N_BOOT,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
) -> pd.DataFrame:
    """tok/J and mean power per series and rung where energy was measured.

    Power is recomputed as energy_decode_j / decode_window_s. Rungs with power_status 'unavailable'
    or no energy are left out (so an empty frame means "not measured"). With ``requests``, tok/J gets
    a bootstrap interval over the per-request tok/J.
    """
    if rungs.empty or "energy_decode_j" not in rungs.columns:
        return pd.DataFrame()
    energy = pd.to_numeric(rungs["energy_decode_j"], errors="coerce")
    ok = energy.notna() & (energy > 0)
    if "power_status" in rungs.columns:
        ok &= rungs["power_status"].fillna("unavailable") != "unavailable"
    sel = rungs[ok].copy()
    if sel.empty:
        return pd.DataFrame()
    sel["power_w"] = [
        power_w(float(e), float(w)) for e, w in zip(sel["energy_decode_j"], sel["decode_window_s"], strict=True)
    ]
    cols = [
        *_keys(sel, SERIES_KEYS),
        "rung",
        "tok_per_j",
        "power_w",
        "energy_decode_j",
        "decode_window_s",
        "power_status",
    ]
    out = sel[cols].reset_index(drop=True)
    if requests is not None and not requests.empty and "tok_per_j" in requests.columns:
        ci = repeat_table(requests, "tok_per_j", statistic=statistic, n_boot=n_boot, level=level, seed=seed)
        if not ci.empty:
            keys = [*_keys(out, SERIES_KEYS), "rung"]
            ci = ci[[*keys, "lo", "hi"]].rename(columns={"lo": "tok_per_j_lo", "hi": "tok_per_j_hi"})
            out = _merge_na(out, ci, keys)
    return out


def _merge_na(left: pd.DataFrame, right: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Left merge that matches missing key values (NA sink/window of non-windowed arms) to each other."""
    sentinel = -(10**12)
    lk, rk = left.copy(), right.copy()
    for frame in (lk, rk):
        for k in keys:
            if pd.api.types.is_numeric_dtype(frame[k]):
                frame[k] = pd.to_numeric(frame[k], errors="coerce").astype("float64").fillna(sentinel)
            else:
                frame[k] = frame[k].astype("object").where(frame[k].notna(), "<NA>")
    merged = lk.merge(rk, on=keys, how="left")
    for k in keys:
        merged[k] = left[k].to_numpy()
    return merged


def cost_side_table(
    rungs: pd.DataFrame,
    requests: pd.DataFrame | None = None,
    *,
    native_arm: str = NATIVE_ARM,
    statistic: Statistic = "median",
    n_boot: int = DEFAULT_N_BOOT,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
) -> pd.DataFrame:
    """Cost-side ratio step_nat / step_win and the wedge (ratio − 1) of every windowed series.

    step = cycleMs of the native (mtp) and the windowed arm at matched model, engine, concurrency, k
    and rung. A cycle's wall time does not depend on how many drafts were accepted, so this is the
    paper's acceptance-free comparison. With ``requests`` the wedge gets a bootstrap interval.
    Empty when the study has no windowed arm.
    """
    rows = []
    if rungs.empty:
        return pd.DataFrame()
    for key, group in group_rows(rungs, SERIES_KEYS):
        if key.get("arm") not in WINDOWED_ARMS:
            continue
        match = {**{k: key[k] for k in _keys(rungs, MATCH_KEYS)}, "k": key.get("k")}
        native = select_rows(rungs, {"arm": native_arm, **match})
        for rung in sorted(set(rungs_of(group)) & set(rungs_of(native))):
            nat = _rung_value(native, {}, rung, "cycle_ms")
            win = _rung_value(group, {}, rung, "cycle_ms")
            row: dict[str, object] = {
                **key,
                "rung": rung,
                "step_nat_ms": nat,
                "step_win_ms": win,
                "ratio": cost_side_ratio(nat, win),
                "wedge": cost_side_wedge(nat, win),
            }
            if requests is not None and not requests.empty:
                tpv_n = _rung_value(native, {}, rung, "tok_per_verify")
                tpv_w = _rung_value(group, {}, rung, "tok_per_verify")
                nat_req = select_rows(requests, {"arm": native_arm, **match, "rung": rung})
                win_req = select_rows(requests, {**key, "rung": rung})

                def wedge(n: np.ndarray, w: np.ndarray, tpv_n: float = tpv_n, tpv_w: float = tpv_w) -> np.ndarray:
                    return cost_side_wedge_of(cycle_ms_of(tpv_n, n), cycle_ms_of(tpv_w, w))

                _, reps = bootstrap_replicates(
                    [nat_req["decode_tok_s"], win_req["decode_tok_s"]],
                    wedge,
                    statistic=statistic,
                    n_boot=n_boot,
                    seed=seed,
                )
                ci = percentile_ci(float(row["wedge"]), reps, level)  # type: ignore[arg-type]
                row["wedge_lo"], row["wedge_hi"] = ci.lo, ci.hi
            rows.append(row)
    return pd.DataFrame(rows)
