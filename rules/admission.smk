# The ring's admission proof: on a vLLM CPU engine, wmtp and wmtp-ring in one KV budget sized so that wmtp
# admits N requests at full length and the ring N + 1; N + 1 arrive at once (wmtp.measure.admission).


rule admission:
    input:
        engine=lambda wc: engine_input(wc.engine),
        model=lambda wc: model_files(wc.model),
        study=ancient(RESOLVED_CONFIG),
    output:
        layout.admission_file(RESULTS, "{model}", "{engine}"),
    log:
        LOGS / "admission" / "{model}~{engine}.log",
    params:
        py=PY,
        # What the proof depends on besides the engine and the model: a change reruns it.
        proof=lambda wc: admission_settings(wc.model, wc.engine),
    resources:
        gpu=1,
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} admission --config {input.study:q} --model {wildcards.model:q} "
        "--engine {wildcards.engine:q} --engine-manifest {input.engine:q} --out {output:q}"
