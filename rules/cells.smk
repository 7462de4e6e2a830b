# One server per cell: warm up, sweep the rungs, write raw files (or failure.json, and fail).


rule cell:
    input:
        engine=lambda wc: engine_input(CELLS[wc.cell].engine),
        model=lambda wc: model_files(CELLS[wc.cell].model),
    output:
        manifest=RESULTS / "raw" / "{cell}" / "manifest.json",
        requests=RESULTS / "raw" / "{cell}" / "requests.parquet",
        counters=RESULTS / "raw" / "{cell}" / "counters.parquet",
    log:
        RESULTS / "logs" / "cells" / "{cell}.log",
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
