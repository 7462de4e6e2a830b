# The ring's admission proof: on a vLLM CPU engine, wmtp and wmtp-ring in one KV budget sized so that wmtp
# admits N requests at full length and the ring N + 1; N + 1 arrive at once (wmtp.measure.admission).


rule admission:
    input:
        engine=lambda wc: engine_input(wc.engine),
        model=lambda wc: model_files(wc.model),
    output:
        layout.admission_file(RESULTS, "{model}", "{engine}"),
    log:
        pipeline=LOGS / "admission" / "{model}~{engine}.log",
        engine=LOGS / "admission" / "{model}~{engine}.engine.log",
    params:
        py=PY,
        # Everything the proof depends on besides the engine's build and the model's files: a change reruns it.
        engine_env=lambda wc: json.dumps(STUDY.engine(wc.engine).env, sort_keys=True),
        # The engine's build: a proof is refused on a build of another spec.
        engine_hash=lambda wc: engine_build_hash(wc.engine),
        model_dir=lambda wc: STUDY.model_dir(wc.model),
        proof=lambda wc: admission_settings(wc.model, wc.engine),
    resources:
        gpu=1,
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log.pipeline:q} admission --model {wildcards.model:q} "
        "--engine-env {params.engine_env:q} --engine-manifest {input.engine:q} --model-dir {params.model_dir:q} "
        "--proof {params.proof:q} --engine-hash {params.engine_hash:q} --out {output:q} --engine-log {log.engine:q}"
