# Engine environments: a pinned venv per engine with wmtp installed into it, self-checked.


rule engine:
    input:
        # Served once by the CPU build's behavioural self-check; a newer checkpoint does not rebuild an engine.
        selfcheck_model=ancient(TRAINED_FIXTURE),
    output:
        engine_manifest("{engine}"),
    log:
        ENGINES / "{engine}" / "build.snakemake.log",
    params:
        py=PY,
        # The engine's spec alone: another change to the study leaves a built engine alone.
        # Keys sorted: the same spec reads the same from config.yaml and from study.json.
        spec=lambda wc: json.dumps(STUDY.engine(wc.engine).model_dump(mode="json"), sort_keys=True),
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} engine-build "
        "--engine {wildcards.engine:q} --engine-json {params.spec:q} --out {output:q}"
