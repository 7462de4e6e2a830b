# The GPU cost-side replica (src/wmtp/replica.py) and its tidy table next to the cost model's
# prediction (src/wmtp/costmodel.py). On a one-GPU CUDA box, from the repository root:
#   snakemake --workflow-profile h200 results/replica/tidy/replica.parquet
# Without a GPU, tidy the committed H200 numbers instead: --config replica='{"raw": "measurements/h200"}'
#
# Config keys, all optional, under `replica:` (defaults in brackets):
#   models     config/models/*.json to measure      [the four paper models]
#   contexts   comma list, k/m suffixes             ["2k,32k,128k,256k,512k,1m"]
#   ks         draft depths                         ["1,3,5"]
#   sink       S, the draft's attention sink        [64]
#   window     W, the draft's sliding window        [4032]  (as config/studies/paper-1m.yaml)
#   reps       timed CUDA-graph replays per piece   [30]
#   label      name of the raw folder (the GPU)     ["h200"]
#   raw        tidy this folder of replica_*.csv instead of running the sweep   [unset]
#   bandwidth  bytes/s for the prediction           [the copy bandwidth measured in the same run]
# Outputs: results/replica/raw/<label>/replica_*.csv, results/replica/tidy/replica.parquet,
# logs under results/replica/logs/.


REPLICA = config.get("replica", {})
REPLICA_RESULTS = Path(STUDY.results_dir) / "replica"
REPLICA_LABEL = REPLICA.get("label", "h200")
REPLICA_MODELS = REPLICA.get(
    "models",
    [
        "config/models/qwen3.6-35b-a3b.json",
        "config/models/qwen3.5-122b-a10b.json",
        "config/models/nemotron-3-super-120b-a12b.json",
        "config/models/qwen3-next-80b-a3b.json",
    ],
)
REPLICA_RAW = Path(REPLICA.get("raw", REPLICA_RESULTS / "raw" / REPLICA_LABEL))


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
        contexts=REPLICA.get("contexts", "2k,32k,128k,256k,512k,1m"),
        ks=REPLICA.get("ks", "1,3,5"),
        sink=REPLICA.get("sink", 64),
        window=REPLICA.get("window", 4032),
        reps=REPLICA.get("reps", 30),
    resources:
        gpu=1,
    # Runs in the GPU machine's own Python (CUDA torch + triton); envs/replica.yaml describes it.
    conda:
        "../envs/replica.yaml"
    shell:
        "{params.py} -m wmtp.replica sweep --models {input} --contexts {params.contexts} --ks {params.ks}"
        " --sink {params.sink} --window {params.window} --reps {params.reps} --out {params.out} > {log} 2>&1"


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
        bandwidth=f"--bandwidth {REPLICA['bandwidth']}" if "bandwidth" in REPLICA else "",
    localrule: True
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp.replica tidy --raw {params.raw} --models-dir config/models {params.bandwidth}"
        " --out {output} > {log} 2>&1"
