# The study report: a papermill notebook rendered to one self-contained HTML page plus figures.


rule report:
    input:
        tidy_tables(),
        notebook="notebooks/report.ipynb",
        replica=REPLICA_RESULTS / "tidy" / "replica.parquet",
    output:
        layout.report_file(RESULTS),
    log:
        LOGS / "report.log",
    params:
        py=PY,
        study=STUDY.study,
        tidy=layout.tidy_dir(RESULTS),
        out=layout.report_file(RESULTS).parent,
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log} report --study {params.study} --tidy {params.tidy} --out {params.out} "
        "--replica {input.replica}"
