# Engine environments: a pinned venv per engine with wmtp installed into it, self-checked.


rule engine:
    output:
        engine_manifest("{engine}"),
    log:
        ENGINES / "{engine}" / "build.snakemake.log",
    params:
        py=PY,
        config=RESOLVED_CONFIG,
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log} engine-build --config {params.config} "
        "--engine {wildcards.engine} --out {output}"
