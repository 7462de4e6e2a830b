# Engine environments: a pinned venv per engine with wmtp installed into it, self-checked.


rule engine:
    output:
        engine_manifest("{engine}"),
    log:
        ENGINES / "{engine}" / "build.snakemake.log",
    params:
        py=PY,
        # The engine's spec alone: another change to the study leaves a built engine alone.
        spec=lambda wc: STUDY.engine(wc.engine).model_dump_json(),
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} engine-build "
        "--engine {wildcards.engine:q} --engine-json {params.spec:q} --out {output:q}"
