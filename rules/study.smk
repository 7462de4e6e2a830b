# The validated study as one JSON file, which every `wmtp` job reads. Rewritten when the study changes;
# the jobs that read it take it as `ancient`, so only the cells whose identity changed rerun.


rule study:
    input:
        # Also rewritten when a study file is newer: the params record alone is lost with .snakemake/.
        workflow.configfiles,
    output:
        RESOLVED_CONFIG,
    log:
        LOGS / "study.log",
    params:
        py=PY,
        study=STUDY_JSON,
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} write-study --out {output:q} --study-json {params.study:q}"
