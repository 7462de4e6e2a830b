# A study measured in pieces (its key `pieces`): one server lifetime of a cell over some of its rungs each, for a
# machine held minutes at a time. Each piece is a target of its own (`wmtp pieces` prints them); the pieces over the
# same rungs are collected together, and a step file is made of every group.


rule piece:
    input:
        unpack(piece_inputs),
    output:
        # Every file a complete piece leaves, as a cell's; the manifest is written last.
        requests=RAW_PIECE / layout.REQUESTS_FILE,
        counters=RAW_PIECE / layout.COUNTERS_FILE,
        energy=RAW_PIECE / layout.ENERGY_FILE,
        power=RAW_PIECE / layout.POWER_FILE,
        server_log=RAW_PIECE / layout.SERVER_LOG,
        manifest=RAW_PIECE / layout.MANIFEST_FILE,
        **profile_output(RAW_PIECE),
    log:
        layout.piece_log(RESULTS, "{group}", "{cell}"),
    params:
        py=PY,
        # The cell's study sweeping the piece's rungs alone, and what that measures: a change reruns a piece that
        # is not there yet, never one that is (its inputs say why).
        study=lambda wc: piece_study_json(wc.group, wc.cell),
        identity=lambda wc: piece_identity_hash(wc.group, wc.cell),
        model_dir=lambda wc: STUDY.model_dir(CELLS[wc.cell].model),
        out=lambda wc: layout.piece_dir(RESULTS, wc.group, wc.cell),
    resources:
        gpu=1,
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} cell --study-json {params.study:q} --cell {wildcards.cell:q} "
        "--engine-manifest {input.engine:q} --model-dir {params.model_dir:q} --out {params.out:q} "
        "--identity {params.identity:q}"


# The listed pieces of one group. No identities are checked: a piece is never measured again, so one measured under
# an earlier engine spec stays what it is (its manifest records which); collect still refuses two protocols.
rule collect_pieces:
    input:
        manifests=lambda wc: piece_manifests(wc.group),
        # What collect reads of each piece besides its manifest.
        tables=lambda wc: [
            m.parent / name for m in piece_manifests(wc.group) for name in layout.COLLECTED_FILES
            if name != layout.MANIFEST_FILE
        ],
        code=source_files("analyze"),
    output:
        layout.piece_tidy_files(RESULTS, "{group}"),
    log:
        LOGS / "collect" / "{group}.log",
    params:
        py=PY,
        out=lambda wc: layout.piece_tidy_dir(RESULTS, wc.group),
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} collect --out {params.out:q} {input.manifests:q}"


# The decode cycle per shape of one model's listed pieces on one engine, over every group, at the one engine
# release their manifests name.
rule step_table:
    input:
        tidy=lambda wc: [
            layout.piece_tidy_dir(RESULTS, g) / f"{name}.parquet"
            for g in step_groups(wc.model, wc.engine)
            for name in ("requests", "rungs")
        ],
        manifests=lambda wc: [
            m for g in step_groups(wc.model, wc.engine) for m in piece_manifests(g, wc.model, wc.engine)
        ],
        code=source_files("analyze"),
    output:
        layout.step_file(RESULTS, "{model}", "{engine}"),
    log:
        LOGS / "steps" / "{model}~{engine}.log",
    params:
        py=PY,
        tidy=lambda wc: [layout.piece_tidy_dir(RESULTS, g) for g in step_groups(wc.model, wc.engine)],
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} step-table --tidy {params.tidy:q} --manifests {input.manifests:q} "
        "--model {wildcards.model:q} --engine {wildcards.engine:q} --out {output:q}"


# A profiling study's traced decode cycles: every measured request's traces, split per component.
rule trace_table:
    input:
        manifests=traced_manifests(),
        requests=[m.parent / layout.REQUESTS_FILE for m in traced_manifests()],
        traces=[m.parent / layout.PROFILE_DIR for m in traced_manifests()],
        code=source_files("analyze"),
    output:
        layout.trace_file(RESULTS),
    log:
        LOGS / "traces.log",
    params:
        py=PY,
        cells=[m.parent for m in traced_manifests()],
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} trace-table {params.cells:q} --out {output:q}"


# Every recorded answer of the listed pieces judged against the same prompt's without a draft (a study that records
# its tokens: protocol.record_tokens).
rule lossless_pieces:
    input:
        requests=[layout.piece_tidy_dir(RESULTS, g) / layout.REQUESTS_FILE for g in piece_groups()],
        code=source_files("analyze"),
    output:
        layout.lossless_file(RESULTS),
    log:
        LOGS / "lossless.log",
    params:
        py=PY,
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} lossless --out {output:q} {input.requests:q}"

