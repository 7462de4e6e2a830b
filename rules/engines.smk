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
        # A newer self-check, or windowed arms added to the study, re-checks the engine (no reinstall).
        checks=ENGINE_CHECKS_VERSION,
        windowed=lambda wc: "--windowed" if STUDY.runs_windowed(wc.engine) else "",
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} engine-build "
        "--engine {wildcards.engine:q} --engine-json {params.spec:q} --out {output:q} {params.windowed}"
