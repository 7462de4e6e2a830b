# Models that the pipeline generates (the tiny hybrid MTP checkpoint of the embedded default).


rule tiny_model:
    input:
        engine=lambda wc: engine_manifest(tiny_builder_engine()),
    output:
        config=MODELS / "{model}" / "config.json",
        weights=MODELS / "{model}" / "model.safetensors",
        tokenizer=MODELS / "{model}" / "tokenizer.json",
    log:
        MODELS / "{model}.log",
    params:
        python=lambda wc: engine_python_of(tiny_builder_engine()),
        seed=lambda wc: STUDY.model(wc.model).seed,
        out=lambda wc: MODELS / wc.model,
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.python} -m wmtp.tiny --out {params.out} --seed {params.seed} > {log} 2>&1"
