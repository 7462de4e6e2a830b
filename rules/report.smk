# The study report: a papermill notebook rendered to one self-contained HTML page plus figures.


rule report:
    input:
        tidy_tables(),
        derived_tables(),
        notebook="notebooks/report.ipynb",
        code=source_files("analyze", "report"),
        replica=REPLICA_RESULTS / "tidy" / "replica.parquet",
        # A real engine's step files beside the replica's step, as the study names them (replica.engine_steps).
        engine_steps=STUDY.replica.engine_steps,
        # A profiling study's trace tables (replica.traces).
        traces=STUDY.replica.traces,
        # Everything else the report reads: editing a published number or a model's facts re-renders it.
        published=sorted(Path(workflow.basedir).glob("config/published/*.csv")),
        models=sorted(Path(workflow.basedir).glob("config/models/*.json")),
        paper_study=Path(workflow.basedir) / "config" / "studies" / "paper-1m.yaml",
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
        "{params.py} -m wmtp --log {log:q} report --study {params.study:q} --tidy {params.tidy:q} --out {params.out:q} "
        "--replica {input.replica:q} --engine-steps {input.engine_steps:q} --traces {input.traces:q}"
