# One server per cell: warm up, sweep the rungs, write raw files (or failure.json, and fail).


rule cell:
    input:
        engine=lambda wc: engine_input(CELLS[wc.cell].engine),
        model=lambda wc: model_files(CELLS[wc.cell].model),
        set_aside=lambda wc: set_aside_records(wc.cell),
    output:
        # Every file a complete cell leaves (wmtp.layout.RAW_SUCCESS_FILES); the manifest is written last.
        requests=RAW_CELL / layout.REQUESTS_FILE,
        counters=RAW_CELL / layout.COUNTERS_FILE,
        energy=RAW_CELL / layout.ENERGY_FILE,
        power=RAW_CELL / layout.POWER_FILE,
        server_log=RAW_CELL / layout.SERVER_LOG,
        manifest=RAW_CELL / layout.MANIFEST_FILE,
        **profile_output(RAW_CELL),
    log:
        LOGS / layout.CELL_LOGS_DIR / "{cell}.log",
    params:
        py=PY,
        # The study narrowed to this cell and the identity of its inputs: a change reruns exactly this cell.
        study=lambda wc: cell_study_json(wc.cell),
        identity=lambda wc: cell_identity_hash(wc.cell),
        engine_hash=lambda wc: engine_hash(CELLS[wc.cell].engine),
        model_dir=lambda wc: STUDY.model_dir(CELLS[wc.cell].model),
        out=lambda wc: cell_dir(wc.cell),
    resources:
        gpu=1,
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} cell --study-json {params.study:q} --cell {wildcards.cell:q} "
        "--engine-manifest {input.engine:q} --model-dir {params.model_dir:q} --out {params.out:q} "
        "--identity {params.identity:q}"


# A complete cell whose raw files are damaged: its files move into a folder of their own inside the cell's, and the
# record of that is an input of the cell, so a plain run measures it again.
rule set_aside:
    output:
        LOGS / layout.DAMAGED_DIR / "{cell}" / "{digest}.json",
    log:
        LOGS / layout.DAMAGED_DIR / "{cell}" / "{digest}.log",
    params:
        py=PY,
        cell_dir=lambda wc: cell_dir(wc.cell),
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} set-aside --cell-dir {params.cell_dir:q} --record {output:q}"
