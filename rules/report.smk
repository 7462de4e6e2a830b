# The study report: a papermill notebook rendered to one self-contained HTML page plus figures.


rule report:
    input:
        tidy_tables(),
        notebook="notebooks/report.ipynb",
    output:
        RESULTS / "report" / "index.html",
    log:
        RESULTS / "logs" / "report.log",
    params:
        tidy=RESULTS / "tidy",
        out=RESULTS / "report",
    localrule: True
    shell:
        "{PY} -m wmtp --log {log} report --study {STUDY.study} --tidy {params.tidy} --out {params.out}"
