# Raw cell files → tidy parquet tables with the derived quantities.


rule collect:
    input:
        cell_manifests(),
    output:
        tidy_tables(),
    log:
        LOGS / "collect.log",
    params:
        py=PY,
        out=layout.tidy_dir(RESULTS),
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp --log {log:q} collect --out {params.out:q} {input:q}"
