"""Bad study files fail before any server starts, with a message naming the key and the value."""

from __future__ import annotations

import pytest

from wmtp.config import Cell, ConfigError, load_study, study_from_dict


def check(raw: dict, *fragments: str) -> None:
    with pytest.raises(ConfigError) as info:
        study_from_dict(raw)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_embedded_study_is_valid(repo):
    study = load_study(repo / "config" / "config.yaml")
    assert [c.cell_id for c in study.cells()] == [
        "model~tiny/engine~vllm-cpu/arm~none/c~1",
        "model~tiny/engine~vllm-cpu/arm~mtp/k~3/c~1",
        "model~tiny/engine~vllm-cpu/arm~wmtp/k~3/s~16/w~256/c~1",
        "model~tiny/engine~vllm-cpu/arm~wmtp/k~3/s~16/w~4096/c~1",
        "model~tiny/engine~vllm-cpu/arm~wmtp-ring/k~3/s~16/w~256/c~1",
    ]
    assert study.protocol.workloads == ["code", "copy"]
    assert study.model("tiny").generate == "trained"


def test_workloads_default_to_code(embedded_raw):
    del embedded_raw["protocol"]["workloads"]
    assert study_from_dict(embedded_raw).protocol.workloads == ["code"]


def test_unknown_workload(embedded_raw):
    embedded_raw["protocol"]["workloads"] = ["code", "chat"]
    check(embedded_raw, "protocol.workloads[1]", "'chat'")


def test_repeated_workload(embedded_raw):
    embedded_raw["protocol"]["workloads"] = ["copy", "copy"]
    check(embedded_raw, "protocol.workloads")


def test_copy_workload_needs_a_long_enough_rung(embedded_raw):
    embedded_raw["protocol"]["rungs"] = [512, 4096, 16384]
    check(embedded_raw, "protocol.rungs[0] = 512", "too short for the copy workload", "≥ 864")
    embedded_raw["protocol"]["workloads"] = ["code"]
    assert study_from_dict(embedded_raw).protocol.rungs[0] == 512


def test_k_zero_on_mtp_arm(embedded_raw):
    embedded_raw["arms"][1]["k"] = [0]
    check(embedded_raw, "arms[1].k[0]", "must be ≥ 1", "'mtp'", "got 0")


def test_unknown_arm(embedded_raw):
    embedded_raw["arms"].append({"name": "eagle"})
    check(embedded_raw, f"config.arms[{len(embedded_raw['arms']) - 1}].name", "'eagle'")


def test_unknown_engine_kind(embedded_raw):
    embedded_raw["engines"][0]["kind"] = "tensorrt"
    check(embedded_raw, "config.engines[0].kind", "'tensorrt'")


def test_context_length_not_positive(embedded_raw):
    embedded_raw["protocol"]["rungs"] = [512, 0]
    check(embedded_raw, "protocol.rungs[1]", "must be > 0", "got 0")


def test_context_length_not_below_max_len(embedded_raw):
    embedded_raw["protocol"]["rungs"] = [1024, 16640]
    check(embedded_raw, "protocol.rungs[1] = 16640", "models[0].max_model_len = 16640")


def test_repeats_below_one(embedded_raw):
    embedded_raw["protocol"]["repeats"] = 0
    check(embedded_raw, "protocol.repeats", "must be ≥ 1", "got 0")
    embedded_raw["protocol"]["repeats"] = [2, 0, 2]
    check(embedded_raw, "protocol.repeats[1]", "got 0")


def test_repeats_list_must_match_rungs(embedded_raw):
    embedded_raw["protocol"]["repeats"] = [2, 2]
    check(embedded_raw, "protocol.repeats has 2 entries", "protocol.rungs has 3")


def test_two_models_with_one_name(embedded_raw):
    embedded_raw["models"].append(dict(embedded_raw["models"][0]))
    check(embedded_raw, "models[1].name 'tiny'", "unique")


def test_windowed_arm_without_sink_or_window(embedded_raw):
    embedded_raw["arms"][2] = {"name": "wmtp", "k": [3], "window": [128]}
    check(embedded_raw, "arms[2].sink", "windowed arm 'wmtp'")
    embedded_raw["arms"][2] = {"name": "wmtp-ring", "k": [3], "sink": [4]}
    check(embedded_raw, "arms[2].window", "windowed arm 'wmtp-ring'")


def test_model_path_does_not_exist(embedded_raw, tmp_path):
    embedded_raw["models"][0] = {"name": "big", "path": str(tmp_path / "nowhere"), "max_model_len": 8192}
    check(embedded_raw, "models[0].path", "nowhere", "does not exist")


def test_model_path_that_exists_is_accepted(embedded_raw, tmp_path):
    embedded_raw["models"][0] = {"name": "big", "path": str(tmp_path), "max_model_len": 32768}
    assert study_from_dict(embedded_raw).model_dir("big") == tmp_path


def test_unknown_key_is_named(embedded_raw):
    embedded_raw["protocol"]["output_tokenz"] = 3
    check(embedded_raw, "config.protocol", "output_tokenz")


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        (
            ("models", 0, "max_model_len"),
            "16640",
            "config.models[0].max_model_len: should be a valid integer (got '16640')",
        ),
        (("models", 0, "max_model_len"), True, "config.models[0].max_model_len: should be a valid integer (got True)"),
        (("protocol", "temperature"), -0.5, "config.protocol.temperature: must be ≥ 0 (got -0.5)"),
        (("protocol", "record_tokens"), "no", "config.protocol.record_tokens: should be a valid boolean (got 'no')"),
        (("protocol", "rungs"), None, "config.protocol: 'rungs' is required"),
        (("engines",), [], "config.engines: must list at least 1 (got [])"),
        (("study",), "my study", "config.study: should match ^[A-Za-z0-9][A-Za-z0-9._-]*$ (got 'my study')"),
        (("protocol", "repeats"), "5", "config: protocol.repeats should be a whole number or a list, one per rung"),
    ],
)
def test_a_keys_type_and_range_are_refused_naming_the_key(embedded_raw, where, value, message):
    """What the field types refuse reads like what the model validators refuse: the key, what it must be, the value."""
    node = embedded_raw
    for key in where[:-1]:
        node = node[key]
    if value is None:
        del node[where[-1]]
    else:
        node[where[-1]] = value
    check(embedded_raw, message)


def test_matrix_expansion_order_and_ids(embedded_raw):
    embedded_raw["arms"] = [
        {"name": "none"},
        {"name": "mtp", "k": [1, 3]},
        {"name": "wmtp", "k": [3], "sink": [0, 16], "window": [128]},
    ]
    embedded_raw["protocol"]["concurrency"] = [1, 4]
    study = study_from_dict(embedded_raw)
    ids = [c.cell_id for c in study.cells()]
    assert len(ids) == (1 + 2 + 2) * 2 == len(set(ids))
    assert ids[0] == "model~tiny/engine~vllm-cpu/arm~none/c~1"
    assert "model~tiny/engine~vllm-cpu/arm~wmtp/k~3/s~0/w~128/c~4" in ids
    for cell in study.cells():
        assert Cell.from_id(study.study, cell.cell_id) == cell


def test_repeats_scalar_expands_per_rung(embedded_raw):
    embedded_raw["protocol"]["repeats"] = 4
    study = study_from_dict(embedded_raw)
    assert study.protocol.repeats == [4, 4, 4]


def test_spark_study_encodes_the_seed_protocol(repo, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "Qwen3.6-35B-A3B-NVFP4-Fast").mkdir(parents=True)
    study = load_study(repo / "config" / "studies" / "spark-128k.yaml")
    assert study.protocol.rungs == [2040, 32779, 131290]
    assert study.protocol.repeats == [6, 4, 5]
    assert study.protocol.output_tokens == 256
    assert study.protocol.concurrency == [1]
    assert study.protocol.warmup_requests == 3
    assert study.protocol.temperature == 0.0
    assert study.models[0].hf_id == "unsloth/Qwen3.6-35B-A3B-NVFP4-Fast"
    assert study.models[0].max_model_len == 262144
    args = study.engines[0].serve_args
    for flag, value in [
        ("--kv-cache-memory-bytes", "4294967296"),
        ("--gpu-memory-utilization", "0.85"),
        ("--max-num-seqs", "4"),
        ("--max-num-batched-tokens", "8192"),
    ]:
        assert args[args.index(flag) + 1] == value
    assert study.engines[0].packages == ["vllm==0.24.0"]
    assert [c.cell_id for c in study.cells()] == [
        "model~qwen3.6-35b-a3b-nvfp4/engine~vllm/arm~none/c~1",
        "model~qwen3.6-35b-a3b-nvfp4/engine~vllm/arm~mtp/k~3/c~1",
    ]


def test_check_config_lists_cells_and_the_sweep(repo, capsys):
    from wmtp.cli import main

    assert main(["check-config", "--config", str(repo / "config" / "config.yaml")]) == 0
    out = capsys.readouterr().out
    assert "is valid: 5 cells" in out
    assert "rungs 1024, 4096, 16384 × repeats [5, 5, 5] on workloads code, copy" in out
    assert "model~tiny/engine~vllm-cpu/arm~wmtp/k~3/s~16/w~4096/c~1" in out


def test_the_copy_tasks_construction_is_part_of_a_cells_identity(embedded_raw, monkeypatch):
    from wmtp.measure import identity

    study = study_from_dict(embedded_raw)
    cell = study.cells()[1]
    before = identity.identity_hash(identity.cell_identity(study, cell))
    assert identity.protocol_identity(study)["copy_task"]["prompts"] == identity.COPY_TASK_PROMPTS
    monkeypatch.setattr(identity, "COPY_TASK_PROMPTS", "another construction")
    assert identity.identity_hash(identity.cell_identity(study, cell)) != before
    embedded_raw["protocol"]["workloads"] = ["code"]
    assert "copy_task" not in identity.protocol_identity(study_from_dict(embedded_raw))


@pytest.mark.parametrize(
    "study_file", ["config.yaml", "studies/paper-1m.yaml", "studies/spark-128k.yaml", "studies/h200-vllm.yaml"]
)
def test_a_cell_recomputes_the_identity_the_workflow_planned(repo, study_file):
    """The workflow plans each cell's identity on the whole study; the cell job recomputes it on the study
    narrowed to itself (its one arm setting and one concurrency). They must agree for every cell, or no cell of
    a study with several concurrencies could run; and cells that differ only in concurrency share a protocol."""
    from wmtp.measure.identity import cell_identity, cell_study, identity_hash

    study = load_study(repo / "config" / study_file)
    protocols = set()
    for cell in study.cells():
        narrowed = study_from_dict(cell_study(study, cell))
        # the study narrowed to the cell's configuration: the cell itself, or its servers where there are several
        assert {c.cell_id.removesuffix(f"/server~{c.server}") for c in narrowed.cells()} == {
            cell.cell_id.removesuffix(f"/server~{cell.server}")
        }
        (own,) = [c for c in narrowed.cells() if c.cell_id == cell.cell_id]
        planned, recomputed = cell_identity(study, cell), cell_identity(narrowed, own)
        assert identity_hash(recomputed) == identity_hash(planned), (cell.cell_id, planned, recomputed)
        protocols.add(identity_hash(recomputed["protocol"]))
    assert len(protocols) == 1


def test_a_setting_listed_twice_is_refused(embedded_raw):
    """A duplicate would be measured once and silently merged; a repeated rung measured the same prompts twice
    and crashed the analysis after every cell had run."""
    import copy

    for where, value, fragment in (
        (("protocol", "rungs"), [1024, 1024, 4096], "protocol.rungs"),
        (("protocol", "concurrency"), [1, 1], "protocol.concurrency"),
    ):
        raw = copy.deepcopy(embedded_raw)
        raw[where[0]][where[1]] = value
        check(raw, fragment, "non-unique")
    raw = copy.deepcopy(embedded_raw)
    raw["arms"][2]["window"] = [256, 256]
    check(raw, "arms[2].window", "non-unique")
    raw = copy.deepcopy(embedded_raw)
    raw["arms"].append({"name": "mtp", "k": [1, 3]})
    check(raw, f"arms[{len(raw['arms']) - 1}] repeats arms[1]'s mtp k=3")
    raw = copy.deepcopy(embedded_raw)
    raw["arms"][0]["k"] = [3]
    check(raw, "arms[0].k", "drafts nothing")


def test_retrained_weights_of_the_same_size_change_the_fingerprint(tmp_path):
    import os

    from wmtp.measure.identity import CONTENT_HASH_MAX_BYTES, model_fingerprint

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * (CONTENT_HASH_MAX_BYTES + 1))
    (tmp_path / "config.json").write_text("{}")
    os.utime(weights, ns=(1_000_000_000, 1_000_000_000))
    before = model_fingerprint(tmp_path)
    weights.write_bytes(b"b" * (CONTENT_HASH_MAX_BYTES + 1))  # new weights, same size, written later
    assert model_fingerprint(tmp_path) != before


@pytest.mark.parametrize(
    "where, arg",
    [
        ("engines", '--additional-config={"wmtp": {"sink": 16, "window": 256}}'),
        ("engines", "--additional-config.wmtp.window=256"),
        ("models", "--speculative-config"),
        ("models", "-sc"),
        ("arms", "--speculative-config"),
        ("arms", "--additional-config.wmtp.sink=0"),
    ],
)
def test_serve_args_cannot_set_what_the_arms_set(embedded_raw, where, arg):
    """Else the mtp reference could be windowed (and the window would seem to cost nothing) or the baseline draft."""
    embedded_raw[where][0]["serve_args"] = [*embedded_raw[where][0].get("serve_args", []), arg]
    check(embedded_raw, f"{where}[0].serve_args", "which each cell's arm sets")


def test_a_cells_part_of_its_identity_is_its_key(repo):
    """The cell's fields, as the identity hashes them: a key added, renamed or dumped differently would rerun every
    measured cell."""
    from wmtp.measure.identity import cell_identity

    study = load_study(repo / "config" / "config.yaml")
    windowed = Cell.from_id(study.study, "model~tiny/engine~vllm-cpu/arm~wmtp/k~3/s~16/w~256/c~1")
    assert cell_identity(study, windowed)["cell"] == {
        "model": "tiny",
        "engine": "vllm-cpu",
        "arm": "wmtp",
        "k": 3,
        "sink": 16,
        "window": 256,
        "concurrency": 1,
    }
    second = Cell.from_id(study.study, "model~tiny/engine~vllm-cpu/arm~none/c~1/server~2")
    assert cell_identity(study, second)["cell"] == {
        "model": "tiny",
        "engine": "vllm-cpu",
        "arm": "none",
        "k": 0,
        "sink": None,
        "window": None,
        "concurrency": 1,
        "server": 2,
    }


def test_an_arms_own_serve_args_reach_its_cells_alone(embedded_raw):
    """An arm entry's serve_args (e.g. another draft kernel for the windowed arm) go to that entry's cells only,
    after the engine's and the model's, and they are part of those cells' identity, no other cell's."""
    from wmtp.measure.identity import cell_identity, cell_study, identity_hash

    before = study_from_dict(embedded_raw)
    embedded_raw["arms"][2]["serve_args"] = ["--max-num-seqs", "2"]
    after = study_from_dict(embedded_raw)
    for cell in after.cells():
        own = ["--max-num-seqs", "2"] if cell.arm == "wmtp" else []
        assert after.arm_args(cell) == own
        assert after.serve_args(cell) == [*after.engine(cell.engine).serve_args, *own]
        changed = identity_hash(cell_identity(after, cell)) != identity_hash(cell_identity(before, cell))
        assert changed == (cell.arm == "wmtp"), cell.cell_id
        narrowed = study_from_dict(cell_study(after, cell))
        assert narrowed.arm_args(cell) == own
    # A study without them dumps as before: its hash (and every identity) is unchanged.
    embedded_raw["arms"][2]["serve_args"] = []
    assert study_from_dict(embedded_raw).config_hash() == before.config_hash()


def test_an_arms_own_serve_args_may_not_open_its_server(embedded_raw):
    embedded_raw["arms"][1]["serve_args"] = ["--host", "0.0.0.0"]
    check(embedded_raw, "arms[1].serve_args --host 0.0.0.0", "unauthenticated")
