# Engine environments: a pinned venv per engine with wmtp installed into it, self-checked.


rule engine:
    input:
        # Served once by the CPU build's behavioural self-check; a newer checkpoint does not rebuild an engine.
        selfcheck_model=ancient(TRAINED_CHECKPOINT),
    output:
        engine_manifest("{engine}"),
    log:
        ENGINES / "{engine}" / "build.snakemake.log",
    params:
        py=PY,
        # What the environment is built from (the spec less its serve arguments), keys sorted so that it reads the
        # same from config.yaml and from study.json: a change rebuilds it, or only re-checks it where the install
        # stands; a change of serve arguments reruns the cells, never the build. Nothing else of the study enters
        # here, so another study on the same engine finds it up to date.
        spec=lambda wc: json.dumps(build_spec(STUDY.engine(wc.engine)), sort_keys=True),
        # A newer self-check re-checks the engine (no reinstall) and so reruns what it serves.
        checks=ENGINE_CHECKS_VERSION,
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} engine-build "
        "--engine {wildcards.engine:q} --engine-json {params.spec:q} --out {output:q}"


# A vLLM release's Python sources (no kernels), read out of its wheel: enough to run its configuration, KV cache
# manager and scheduler without a GPU (wmtp.measure.ring_blocks).
rule vllm_sources:
    output:
        ENGINES / "sources" / "vllm-{version}" / "manifest.json",
    log:
        ENGINES / "sources" / "vllm-{version}.log",
    wildcard_constraints:
        version=r"\d+\.\d+\.\d+",
    params:
        py=PY,
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} vllm-sources --version {wildcards.version:q} --out {output:q}"


# The SGLang sources the SGLang plugin's hook check reads (wmtp.engines.sglang_hooks), out of a release's wheel, and
# the check's result in the manifest.
rule sglang_sources:
    output:
        ENGINES / "sources" / "sglang-{version}" / "manifest.json",
    log:
        ENGINES / "sources" / "sglang-{version}.log",
    wildcard_constraints:
        version=r"\d+\.\d+\.\d+",
    params:
        py=PY,
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} sglang-sources --version {wildcards.version:q} --out {output:q}"
