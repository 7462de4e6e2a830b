# Raw cell files → tidy parquet tables with the derived quantities.


rule collect:
    input:
        cell_manifests(),
    output:
        tidy_tables(),
    log:
        RESULTS / "logs" / "collect.log",
    params:
        py=PY,
        out=RESULTS / "tidy",
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log} collect --out {params.out} {input}"
