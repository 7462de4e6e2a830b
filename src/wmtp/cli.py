"""The ``wmtp`` command: what the Snakemake rules call, and what a person runs by hand."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from wmtp import layout
from wmtp.config import Cell, ConfigError, EngineSpec, Study, load_study, study_from_dict, study_warnings
from wmtp.layout import REPO_ROOT

# A log record that goes to the log file alone (an uncaught error, whose traceback Python prints on the screen).
FILE_ONLY = "wmtp_file_only"


def _setup_logging(log_file: Path | None) -> None:
    screen = logging.StreamHandler(sys.stderr)
    screen.addFilter(lambda record: not getattr(record, FILE_ONLY, False))
    handlers: list[logging.Handler] = [screen]
    if log_file:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=handlers, force=True
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _study(args: argparse.Namespace) -> Study:
    if getattr(args, "study_json", None):  # what a rule hands its job: the study as one JSON object
        return study_from_dict(json.loads(args.study_json), base_dir=Path.cwd())
    overrides = json.loads(args.overrides) if getattr(args, "overrides", None) else None
    return load_study(args.config, overrides=overrides, base_dir=Path.cwd())


def cmd_check_config(args: argparse.Namespace) -> int:
    from wmtp.engines.capacity import check_weightless_fit

    study = _study(args)
    check_weightless_fit(study)
    cells = study.cells()
    protocol = study.protocol
    print(f"{args.config}: study {study.study!r} is valid: {len(cells)} cells")
    # Also logged on stderr by load_study; printed here so the listing shows everything the run will be.
    for warning in study_warnings(study):
        print(f"  warning: {warning}")
    print(
        f"  each sweeps rungs {', '.join(map(str, protocol.rungs))} × repeats {protocol.repeats} on "
        f"workloads {', '.join(protocol.workloads)}"
    )
    for cell in cells:
        print(f"  {cell.cell_id}")
    return 0


def cmd_engine_build(args: argparse.Namespace) -> int:
    from wmtp.engines.build import build_engine

    # The engine rule passes the spec alone, so that no other change to the study rebuilds it.
    spec = EngineSpec.model_validate_json(args.engine_json) if args.engine_json else _study(args).engine(args.engine)
    out = Path(args.out).parent if args.out.endswith(".json") else Path(args.out)
    build_engine(spec, out, force=args.force, windowed=args.windowed)
    return 0


def cmd_cell_run(args: argparse.Namespace) -> int:
    from wmtp.measure.cell import CellRun, run_cell

    study = _study(args)
    cell = Cell.from_id(study.study, args.cell)
    if cell not in study.cells():
        raise ConfigError(f"cell {args.cell!r} is not in study {study.study!r}")
    engine_manifest = json.loads(Path(args.engine_manifest).read_text())
    run = CellRun(
        study=study,
        cell=cell,
        out_dir=Path(args.out),
        engine_manifest=engine_manifest,
        model_dir=Path(args.model_dir),
        gpu_index=args.gpu,
        cache_dir=Path(args.engine_manifest).resolve().parent / "cache",
        expected_identity=args.identity,
    )
    run_cell(run)
    return 0


def cmd_cell_study(args: argparse.Namespace) -> int:
    from wmtp.measure.identity import cell_study, narrow_rungs

    study = _study(args)
    cell = Cell.from_id(study.study, args.cell)
    if cell not in study.cells():
        raise ConfigError(f"cell {args.cell!r} is not in study {study.study!r}")
    raw = cell_study(study, cell)
    if args.rungs:
        raw = narrow_rungs(raw, args.rungs)
    print(json.dumps(raw, sort_keys=True))
    return 0


def cmd_iteration_statistic(args: argparse.Namespace) -> int:
    import dataclasses

    from wmtp.analyze import scheduler_log

    read = scheduler_log.vllm_lines if args.engine == "vllm" else scheduler_log.sglang_lines
    ramp = scheduler_log.RAMP_LINES[args.engine] if args.ramp is None else args.ramp
    for log in args.logs:
        with log.open(errors="replace") as lines:
            runs = scheduler_log.segments(lines, args.engine) if args.segments else [read(lines)]
        for i, run in enumerate(runs):
            found = scheduler_log.iteration_statistic(run, args.batch, ramp)
            figures = dataclasses.asdict(found) if found else {"lines": 0}
            where = {"segment": i} if args.segments else {}
            print(json.dumps({"log": str(log), **where, "batch": args.batch, **figures}))
    return 0


def cmd_lossless(args: argparse.Namespace) -> int:
    """Tidy requests tables → each recorded answer judged against the same prompt's without a draft, as CSV; the
    summary per series in the log."""
    import pandas as pd

    from wmtp.analyze.lossless import lossless_summary, lossless_table

    frames = [pd.read_parquet(path) for path in args.requests]
    requests = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    table = lossless_table(requests)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    summary = lossless_summary(table)
    logging.getLogger("wmtp.lossless").info("wrote %s: %d answers judged\n%s", args.out, len(table), summary)
    return 0


def cmd_scheduler_steps(args: argparse.Namespace) -> int:
    """SGLang cells (whole or pieces) → the paper's iteration per rung from each server's decode log, CSV
    (``scheduler_log.cell_rows``)."""
    import pandas as pd

    from wmtp.analyze import scheduler_log

    rows = []
    for manifest_path in args.manifests:
        manifest = json.loads(manifest_path.read_text())
        with (manifest_path.parent / layout.SERVER_LOG).open(errors="replace") as log:
            rows += scheduler_log.cell_rows(manifest, log)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=scheduler_log.CELL_COLUMNS).to_csv(args.out, index=False)
    logging.getLogger("wmtp.scheduler").info("wrote %s: %d rungs of %d cells", args.out, len(rows), len(args.manifests))
    return 0


def cmd_trace_table(args: argparse.Namespace) -> int:
    """Profiled cells' traces → one row per (traced request, component): steps, wall, device busy and idle, the
    component's device time and its byte floor (µs)."""
    import pandas as pd

    from wmtp.analyze.traces import TABLE_COLUMNS, cell_trace_table

    rows = cell_trace_table(args.cells)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=TABLE_COLUMNS).to_csv(args.out, index=False)
    logging.getLogger("wmtp.traces").info("wrote %s: %d rows from %d cells", args.out, len(rows), len(args.cells))
    return 0


def cmd_step_table(args: argparse.Namespace) -> int:
    import pandas as pd

    from wmtp.analyze.steps import MixedReleases, engine_release, step_table

    try:
        version = args.engine_version or engine_release(json.loads(m.read_text()) for m in args.manifests)
    except MixedReleases as err:
        logging.getLogger("wmtp").error("step-table: %s", err)
        return 2
    tables: dict[str, list[pd.DataFrame]] = {name: [] for name in ("requests", "rungs")}
    for folder in args.tidy:  # a study's tidy folder, or one per group of pieces
        for name, frames in tables.items():
            frame = pd.read_parquet(folder / f"{name}.parquet")
            for column in ("model", "engine"):
                if getattr(args, column):
                    frame = frame[frame[column] == getattr(args, column)]
            frames.append(frame)
    requests, rungs = (pd.concat(frames, ignore_index=True) for frames in tables.values())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    step_table(requests, rungs, version, workload=args.workload).to_csv(args.out, index=False)
    logging.getLogger("wmtp").info("wrote %s", args.out)
    return 0


def cmd_pieces(args: argparse.Namespace) -> int:
    from wmtp.config import expand_pieces, select_pieces

    study = _study(args)
    results = layout.study_dir(study.results_dir, study.study)
    pieces = expand_pieces(study)
    if not pieces:
        raise ConfigError(f"study {study.study!r} declares no pieces (its key `pieces`)")
    if args.step_files:
        for model, engine in sorted({(p.cell.model, p.cell.engine) for p in pieces}):
            print(layout.step_file(results, model, engine))
        if study.protocol.profile_iterations:
            print(layout.trace_file(results))
        return 0
    chosen = select_pieces(pieces, args.arms, args.k, args.windows, args.servers, args.rungs)
    if not chosen:
        raise ConfigError(f"no piece of study {study.study!r} is picked by this selection")
    for piece in chosen:
        print(layout.piece_dir(results, piece.group, piece.cell.cell_id) / layout.MANIFEST_FILE)
    return 0


def cmd_admission(args: argparse.Namespace) -> int:
    from wmtp.engines.build import check_build_hash
    from wmtp.measure.admission import run_in_engine

    proof = json.loads(args.proof)
    engine_manifest = json.loads(Path(args.engine_manifest).read_text())
    if args.engine_hash is not None:
        check_build_hash(engine_manifest, args.engine_hash)
    model_dir, out = Path(args.model_dir), Path(args.out)
    measured = out.with_name(out.name + ".engine")
    engine_log = Path(args.engine_log) if args.engine_log else out.with_name(out.name + ".log")
    try:
        result = run_in_engine(
            engine_manifest["python"],
            json.loads(args.engine_env),
            model_dir,
            measured,
            proof["sink"],
            proof["window"],
            proof["k"],
            max_model_len=proof["max_model_len"],
            log_file=engine_log,
        )
        if result["arms"]:
            result["predicted"] = predicted_reclaim(model_dir / "config.json", result, args.model)
    finally:
        measured.unlink(missing_ok=True)
    out.write_text(json.dumps(result, indent=2))
    logging.getLogger("wmtp").info("admission %s: %s (engine output: %s)", args.model, result["verdict"], engine_log)
    return 0


def cmd_vllm_sources(args: argparse.Namespace) -> int:
    from wmtp.engines.vllm_versions import fetch_sources

    out = Path(args.out)
    found = fetch_sources(args.version, out.parent)
    out.write_text(json.dumps(found, indent=2))
    logging.getLogger("wmtp").info(
        "vLLM %s: %d Python files, %d bytes in %d range requests",
        args.version,
        found["members"],
        found["bytes_read"],
        found["range_requests"],
    )
    return 0


def cmd_sglang_sources(args: argparse.Namespace) -> int:
    from wmtp.engines.sglang_hooks import fetch_sources

    out = Path(args.out)
    found = fetch_sources(args.version, out.parent)
    out.write_text(json.dumps(found, indent=2))
    checked = found["hook_points"]
    logging.getLogger("wmtp").info(
        "SGLang %s: %d Python files in %d range requests; the plugin's hook points %s",
        args.version,
        found["members"],
        found["range_requests"],
        "are all there" if checked["ok"] else f"lack {checked['missing']}",
    )
    return 0


def predicted_reclaim(config_file: Path, measured: dict, name: str) -> dict[str, float]:
    """The cost model's bytes per request of the proof's length under wmtp and the ring, and the share reclaimed."""
    from wmtp.analyze import costmodel

    spec = costmodel.model_from_hf_config(json.loads(config_file.read_text()), name, weights=False)
    context, sink, window = measured["max_model_len"], measured["sink"], measured["window"]
    plain = costmodel.kv_memory(spec, context, sink=sink, window=window, ring=False).total
    ring = costmodel.kv_memory(spec, context, sink=sink, window=window, ring=True).total
    return {"bytes_per_request_wmtp": plain, "bytes_per_request_ring": ring, "reclaimed_fraction": 1 - ring / plain}


def cmd_write_study(args: argparse.Namespace) -> int:
    from wmtp.config import resolved_study_json, study_from_dict

    study = study_from_dict(json.loads(args.study_json), base_dir=Path.cwd())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(resolved_study_json(study))
    tmp.replace(args.out)
    return 0


def cmd_collect(args: argparse.Namespace) -> int:
    from wmtp.analyze.tidy import MixedProtocols, collect

    manifests = [Path(p) for p in args.manifests]
    expected = json.loads(args.identities) if args.identities else None
    try:
        collect([m.parent for m in manifests], Path(args.out), [Path(a) for a in args.admission], expected)
    except MixedProtocols as err:
        logging.getLogger("wmtp").error("%s", err)
        return 2
    return 0


def cmd_set_aside(args: argparse.Namespace) -> int:
    from wmtp.measure.cell import set_aside_damaged

    set_aside_damaged(Path(args.cell_dir), Path(args.record))
    return 0


def cmd_derive(args: argparse.Namespace) -> int:
    from wmtp.analyze.derive import derive

    derive(Path(args.tidy), Path(args.out))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from wmtp.report.render import main_report

    return main_report(args.rest)


def cmd_progress(args: argparse.Namespace) -> int:
    from wmtp.measure.render_progress import show_progress

    study = _study(args)
    results = layout.study_dir(study.results_dir, study.study)
    return show_progress([c.cell_id for c in study.cells()], results, follow=args.follow, phases=args.phases)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wmtp", description="Speculative decoding at long context, end to end.")
    parser.add_argument("--log", type=Path, help="also write the log to this file")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--config", default=str(REPO_ROOT / "config" / "config.yaml"), help="study file")
        p.add_argument("--overrides", help="JSON object merged over the study file (as snakemake --config)")
        p.add_argument("--study-json", help="the study as one JSON object, instead of --config")
        return p

    p = with_config(sub.add_parser("check-config", help="validate a study and list its cells"))
    p.set_defaults(func=cmd_check_config)

    p = with_config(sub.add_parser("engine-build", help="build or adopt an engine environment"))
    p.add_argument("--engine", required=True)
    p.add_argument("--engine-json", help="the engine's spec as one JSON object, instead of the study's entry")
    p.add_argument("--out", required=True, help="the engine's manifest.json (its folder holds the venv)")
    p.add_argument(
        "--windowed", action="store_true", help="the study runs wmtp or wmtp-ring here: a failed hook check fails"
    )
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_engine_build)

    p = with_config(sub.add_parser("cell", help="run one cell"))
    p.add_argument("--cell", required=True, help="cell id, e.g. model~tiny/engine~vllm-cpu/arm~mtp/k~3/c~1")
    p.add_argument("--engine-manifest", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True, help="the cell's raw directory")
    p.add_argument("--gpu", type=int, default=None, help="GPU index to measure (default: CUDA_VISIBLE_DEVICES)")
    p.add_argument("--identity", help="the identity hash the workflow planned this cell with; refuse another")
    p.set_defaults(func=cmd_cell_run)

    p = with_config(sub.add_parser("progress", help="which cells are done, which is running, and the time left"))
    p.add_argument("--follow", action="store_true", help="redraw every 2 s until every cell is done (Ctrl-C stops)")
    p.add_argument("--phases", action="store_true", help="also each cell's time per phase (start, warm-up, rungs)")
    p.set_defaults(func=cmd_progress)

    p = with_config(sub.add_parser("cell-study", help="print the study narrowed to one cell, as its rule hands it"))
    p.add_argument("--cell", required=True)
    p.add_argument("--rungs", type=int, nargs="*", help="only these of the protocol's rungs (one server lifetime)")
    p.set_defaults(func=cmd_cell_study)

    p = with_config(
        sub.add_parser("pieces", help="the target paths of a study's pieces (or its step files), in the order to run")
    )
    p.add_argument("--arms", nargs="+", default=[], help="only these arms, each server's pieces in this order")
    p.add_argument("--k", type=int, nargs="+", default=[], help="of the drafting arms' pieces, only these k")
    p.add_argument("--windows", type=int, nargs="+", default=[], help="of the windowed arms' pieces, only these W")
    p.add_argument("--servers", type=int, nargs="+", default=[], help="only these of each configuration's servers")
    p.add_argument("--rungs", type=int, nargs="+", default=[], help="only the pieces over exactly these rungs")
    p.add_argument(
        "--step-files",
        action="store_true",
        help="print the step files the pieces make instead (and a profiling study's trace table)",
    )
    p.set_defaults(func=cmd_pieces)

    p = sub.add_parser("step-table", help="tidy tables → the decode cycle per (arm, k, S, W, context, batch), CSV")
    p.add_argument("--tidy", type=Path, nargs="+", required=True, help="folders holding requests/rungs.parquet")
    release = p.add_mutually_exclusive_group(required=True)
    release.add_argument("--engine-version", help="the engine release the cells ran, e.g. 0.24.0")
    release.add_argument(
        "--manifests", type=Path, nargs="+", help="the cells' manifest.json, which name the engine release they ran"
    )
    p.add_argument("--model", help="only this model's cells")
    p.add_argument("--engine", help="only the cells of the engine of this name")
    p.add_argument("--workload", default="code")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_step_table)

    p = sub.add_parser("lossless", help="tidy requests → each recorded answer against the no-draft answer, CSV")
    p.add_argument("requests", type=Path, nargs="+", help="tidy requests.parquet files (one per group of pieces)")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_lossless)

    p = sub.add_parser("scheduler-steps", help="SGLang cells → the paper's iteration per rung from the server log, CSV")
    p.add_argument("manifests", type=Path, nargs="+", help="the cells' manifest.json, their server.log beside")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_scheduler_steps)

    p = sub.add_parser("trace-table", help="profiled cells → each traced decode cycle's time per component, CSV")
    p.add_argument("cells", type=Path, nargs="+", help="raw cell folders of a profiling study")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_trace_table)

    p = sub.add_parser(
        "iteration-statistic", help="the paper's iteration (TPOT × accept length) from a server log's decode lines"
    )
    p.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    p.add_argument("--batch", type=int, default=1, help="the requests running together in a steady-state line")
    p.add_argument(
        "--ramp", type=int, default=None, help="steady lines dropped at the start (default: sglang 2, vllm 0)"
    )
    p.add_argument(
        "--segments", action="store_true", help="one line per decode between two prefills (a request, one at a time)"
    )
    p.add_argument("logs", type=Path, nargs="+", help="server logs")
    p.set_defaults(func=cmd_iteration_statistic)

    p = sub.add_parser("write-study", help="validate a resolved study (JSON) and write it, as the rules read it")
    p.add_argument("--study-json", required=True, help="the study as one JSON object")
    p.add_argument("--out", required=True, type=Path)
    p.set_defaults(func=cmd_write_study)

    p = sub.add_parser("admission", help="the ring's admission proof for one model on one engine")
    p.add_argument("--model", required=True, help="the model's name")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--engine-env", default="{}", help="the engine's environment variables as one JSON object")
    p.add_argument("--engine-manifest", required=True)
    p.add_argument("--engine-hash", help="the build hash the study gives the engine: a build of another is refused")
    p.add_argument(
        "--proof", required=True, help='{"sink": S, "window": W, "k": K, "max_model_len": L} of the ring cell'
    )
    p.add_argument("--out", required=True)
    p.add_argument("--engine-log", help="where the engine's own output goes (default: beside --out)")
    p.set_defaults(func=cmd_admission)

    p = sub.add_parser(
        "vllm-sources", help="a vLLM release's Python sources, read out of its wheel (its scheduler runs without a GPU)"
    )
    p.add_argument("--version", required=True)
    p.add_argument("--out", required=True, help="the manifest; the sources go beside it, under vllm/")
    p.set_defaults(func=cmd_vllm_sources)

    p = sub.add_parser(
        "sglang-sources", help="the SGLang sources the SGLang plugin's hook check reads, out of a release's wheel"
    )
    p.add_argument("--version", required=True)
    p.add_argument("--out", required=True, help="the manifest, with the check's result; the sources go under sglang/")
    p.set_defaults(func=cmd_sglang_sources)

    p = sub.add_parser("collect", help="raw cells → tidy parquet tables")
    p.add_argument("--out", required=True)
    p.add_argument("manifests", nargs="+", help="the manifest.json of each cell")
    p.add_argument("--admission", nargs="*", default=[], help="the ring's admission proofs (raw/admission/*.json)")
    p.add_argument("--identities", help="JSON {cell id: identity hash} the study gives its cells: others are refused")
    p.set_defaults(func=cmd_collect)

    p = sub.add_parser("set-aside", help="move a damaged cell's raw files aside so that it is measured again")
    p.add_argument("--cell-dir", required=True, help="results/<study>/raw/<cell id>")
    p.add_argument("--record", required=True, help="where to record what was damaged and where it went")
    p.set_defaults(func=cmd_set_aside)

    p = sub.add_parser("derive", help="tidy tables → the derived tables the report shows")
    p.add_argument("--tidy", required=True, help="results/<study>/tidy")
    p.add_argument("--out", required=True, help="results/<study>/derived")
    p.set_defaults(func=cmd_derive)

    p = sub.add_parser(
        "report", help="render the study report (papermill → HTML); options as wmtp.report.render", add_help=False
    )
    p.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "report":
        args.rest = rest  # wmtp.report.render parses its own options
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    _setup_logging(args.log)
    from wmtp.engines.base import CellRefused

    try:
        return args.func(args)
    except (ConfigError, CellRefused) as err:
        logging.getLogger("wmtp").error("%s", err)
        return 2
    except Exception:
        # Into the rule's log too: the log is where a failed job says why. The screen gets Python's own traceback.
        logging.getLogger("wmtp").exception("wmtp %s failed", args.command, extra={FILE_ONLY: True})
        raise
