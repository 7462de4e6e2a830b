# The validated study as one JSON file: the record of what this run is for, rewritten when the study changes.
# Jobs get what they depend on as arguments (a cell its study narrowed to itself), never this file, so only the
# jobs whose own inputs changed rerun.


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
