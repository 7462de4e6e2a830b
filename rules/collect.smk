# Raw cell files → tidy parquet tables with the derived quantities.


rule collect:
    input:
        cell_manifests(),
    output:
        tidy_tables(),
    log:
        RESULTS / "logs" / "collect.log",
    params:
        out=RESULTS / "tidy",
    localrule: True
    shell:
        "{PY} -m wmtp --log {log} collect --out {params.out} {input}"
