# One server per cell: warm up, sweep the rungs, write raw files (or failure.json, and fail).


rule cell:
    input:
        engine=lambda wc: engine_input(CELLS[wc.cell].engine),
        model=lambda wc: model_files(CELLS[wc.cell].model),
    output:
        # Every file a complete cell leaves (wmtp.layout.RAW_SUCCESS_FILES); the manifest is written last.
        requests=RAW_CELL / layout.REQUESTS_FILE,
        counters=RAW_CELL / layout.COUNTERS_FILE,
        energy=RAW_CELL / layout.ENERGY_FILE,
        power=RAW_CELL / layout.POWER_FILE,
        server_log=RAW_CELL / layout.SERVER_LOG,
        manifest=RAW_CELL / layout.MANIFEST_FILE,
    log:
        LOGS / "cells" / "{cell}.log",
    params:
        py=PY,
        config=RESOLVED_CONFIG,
        engine_hash=lambda wc: engine_hash(CELLS[wc.cell].engine),
        model_dir=lambda wc: STUDY.model_dir(CELLS[wc.cell].model),
        out=lambda wc: cell_dir(wc.cell),
    resources:
        gpu=1,
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log} cell --config {params.config} --cell {wildcards.cell} "
        "--engine-manifest {input.engine} --model-dir {params.model_dir} --out {params.out}"
