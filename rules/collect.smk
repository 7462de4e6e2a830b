# Raw cell files → tidy parquet tables with the derived quantities, then the derived tables the report shows.


rule collect:
    input:
        manifests=cell_manifests(),
        admission=admission_files(),
        code=source_files("analyze"),
    output:
        tidy_tables(),
    log:
        LOGS / "collect.log",
    params:
        py=PY,
        out=layout.tidy_dir(RESULTS),
        # What each cell's recorded identity must be: cells measured for another study file are refused.
        identities=lambda wc: cell_identities_json(),
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    # --admission last: its files (none, in a study without wmtp-ring) end the argument list.
    shell:
        "{params.py} -m wmtp --log {log:q} collect --out {params.out:q} --identities {params.identities:q} "
        "{input.manifests:q} --admission {input.admission:q}"


rule derive:
    input:
        tidy_tables(),
        code=source_files("analyze"),
    output:
        derived_tables(),
    log:
        LOGS / "derive.log",
    params:
        py=PY,
        tidy=layout.tidy_dir(RESULTS),
        out=layout.derived_dir(RESULTS),
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} derive --tidy {params.tidy:q} --out {params.out:q}"


# The paper's own statistic per rung of every SGLang cell, from its server's decode log: the scheduler's clock beside
# the per-request one (wmtp.analyze.scheduler_log).
rule scheduler_steps:
    input:
        manifests=measured_manifests(),
        logs=[m.parent / layout.SERVER_LOG for m in measured_manifests()],
        code=source_files("analyze"),
    output:
        layout.scheduler_steps_file(RESULTS),
    log:
        LOGS / "scheduler_steps.log",
    params:
        py=PY,
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} scheduler-steps --out {output:q} {input.manifests:q}"
