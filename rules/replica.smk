# The GPU cost-side replica (src/wmtp/replica/) and its tidy table next to the cost model's
# prediction (src/wmtp/analyze/costmodel.py). On a one-GPU CUDA box, from the repository root:
#   snakemake --workflow-profile h200 results/replica/tidy/replica.parquet
# Without a GPU, tidy the committed H200 numbers instead: --config replica='{"raw": "measurements/h200"}'
#
# Config keys, all optional, under `replica:`: wmtp.config.ReplicaSettings (its defaults, one place).
# Outputs: results/replica/raw/<label>/replica_*.csv, results/replica/tidy/replica.parquet,
# logs under results/replica/logs/.


REPLICA = STUDY.replica
REPLICA_RESULTS = Path(STUDY.results_dir) / "replica"
REPLICA_LABEL = REPLICA.label
REPLICA_MODELS = REPLICA.models
REPLICA_RAW = Path(REPLICA.raw) if REPLICA.raw else REPLICA_RESULTS / "raw" / REPLICA_LABEL


rule replica:
    input:
        REPLICA_MODELS,
    output:
        steps=REPLICA_RESULTS / "raw" / REPLICA_LABEL / "replica_steps.csv",
        bandwidth=REPLICA_RESULTS / "raw" / REPLICA_LABEL / "replica_bandwidth.csv",
    log:
        REPLICA_RESULTS / "logs" / f"replica_{REPLICA_LABEL}.log",
    params:
        py=PY,
        out=REPLICA_RESULTS / "raw" / REPLICA_LABEL,
        contexts=REPLICA.contexts,
        ks=REPLICA.ks,
        batches=REPLICA.batches,
        sink=REPLICA.sink,
        window=REPLICA.window,
        reps=REPLICA.reps,
    resources:
        gpu=1,
    # Runs in the GPU machine's own Python (CUDA torch + triton); envs/replica.yaml describes it.
    conda:
        "../envs/replica.yaml"
    shell:
        "{params.py} -m wmtp.replica sweep --models {input:q} --contexts {params.contexts:q} --ks {params.ks:q}"
        " --batches {params.batches:q} --sink {params.sink:q} --window {params.window:q} --reps {params.reps:q}"
        " --out {params.out:q} > {log:q} 2>&1"


rule replica_tidy:
    input:
        steps=REPLICA_RAW / "replica_steps.csv",
        bandwidth=REPLICA_RAW / "replica_bandwidth.csv",
        models=REPLICA_MODELS,
    output:
        REPLICA_RESULTS / "tidy" / "replica.parquet",
    log:
        REPLICA_RESULTS / "logs" / "replica_tidy.log",
    params:
        py=PY,
        raw=REPLICA_RAW,
        bandwidth=["--bandwidth", str(REPLICA.bandwidth)] if REPLICA.bandwidth is not None else [],
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp.replica tidy --raw {params.raw:q} --models-dir config/models {params.bandwidth:q}"
        " --out {output:q} > {log:q} 2>&1"
