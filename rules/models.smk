# Models that the pipeline generates: the tiny hybrid MTP checkpoint of the embedded default, with
# random weights (generate: tiny) or trained (generate: trained: the committed fixture, checked
# against its hashes; rule train_tiny trains the CPU recipe of the same family from scratch); and
# weightless checkpoints of a real architecture (generate: dummy), served with --load-format dummy.


rule tiny_model:
    input:
        engine=lambda wc: engine_input(tiny_builder_engine()),
    output:
        config=MODELS / "{model}" / "config.json",
        weights=MODELS / "{model}" / "model.safetensors",
        tokenizer=MODELS / "{model}" / "tokenizer.json",
    wildcard_constraints:
        model=generated_names("tiny"),
    log:
        MODELS / "{model}.log",
    params:
        python=lambda wc: engine_python_of(tiny_builder_engine()),
        seed=lambda wc: STUDY.model(wc.model).seed,
        out=lambda wc: MODELS / wc.model,
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.python:q} -m wmtp.model.tiny --out {params.out:q} --seed {params.seed:q} > {log:q} 2>&1"


# Copies and hash-checks the committed checkpoint: seconds of work, so never a batch job.
rule trained_model:
    localrule: True
    input:
        fixture=[TRAINED_CHECKPOINT / name for name in ("wmtp-model.json", "config.json", "model.safetensors",
                                                       "tokenizer.json", "tokenizer_config.json")],
    output:
        config=MODELS / "{model}" / "config.json",
        weights=MODELS / "{model}" / "model.safetensors",
        tokenizer=MODELS / "{model}" / "tokenizer.json",
    wildcard_constraints:
        model=generated_names("trained"),
    log:
        MODELS / "{model}.log",
    params:
        py=PY,
        seed=lambda wc: STUDY.model(wc.model).seed,
        out=lambda wc: MODELS / wc.model,
        fixture=TRAINED_CHECKPOINT,
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp.model.train install --fixture {params.fixture:q} --out {params.out:q} --seed {params.seed:q} > {log:q} 2>&1"


# config.json and a padded tokenizer from an architecture facts file (wmtp.model.dummy): seconds, tokenizers only.
rule dummy_model:
    localrule: True
    input:
        architecture=lambda wc: architecture_file(STUDY.model(wc.model).architecture),
        tokenizer=TRAINED_CHECKPOINT / "tokenizer.json",
    output:
        config=MODELS / "{model}" / "config.json",
        tokenizer=MODELS / "{model}" / "tokenizer.json",
        tokenizer_config=MODELS / "{model}" / "tokenizer_config.json",
        manifest=MODELS / "{model}" / "wmtp-model.json",
    wildcard_constraints:
        model=generated_names("dummy"),
    log:
        MODELS / "{model}.log",
    params:
        py=PY,
        out=lambda wc: MODELS / wc.model,
        # Its max_position_embeddings: the study's length for the model, which the config check relies on.
        max_len=lambda wc: STUDY.model(wc.model).max_model_len,
        quantization=lambda wc: STUDY.model(wc.model).quantization or "none",
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp.model.dummy --architecture {input.architecture:q} --out {params.out:q} "
        "--max-position-embeddings {params.max_len:q} --quantization {params.quantization:q} > {log:q} 2>&1"


# A checkpoint on disk served with the study's RoPE scaling written into its config (wmtp.model.stretch): a folder
# under the models directory with that config.json and a link to every other file of the checkpoint.
rule stretched_model:
    localrule: True
    input:
        # A fetched checkpoint's download record, or a local checkpoint's own config.
        checkpoint=lambda wc: checkpoint_files(STRETCHED[wc.model]) or [f"{STRETCHED[wc.model].path}/config.json"],
    output:
        config=MODELS / "{model}" / "config.json",
    wildcard_constraints:
        model="|".join(re.escape(name) for name in STRETCHED) or "(?!)",
    log:
        MODELS / "{model}.log",
    params:
        py=PY,
        source=lambda wc: STRETCHED[wc.model].path,
        out=lambda wc: MODELS / wc.model,
        rope_scaling=lambda wc: json.dumps(STRETCHED[wc.model].rope_scaling, sort_keys=True),
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp.model.stretch --source {params.source:q} --out {params.out:q} "
        "--rope-scaling {params.rope_scaling:q} --log {log:q}"


# Trains the CPU recipe (wmtp.model.train, "cpu": 512-token rows, bitwise reproducible) from scratch on this CPU
# (about 15 min on two cores); not part of `all`. Ask for it by path, e.g.
# `snakemake results/models/tiny.train/model.safetensors`. The committed checkpoint is the GPU recipe
# (scripts/device/train_far_gpu.sh): its model copies from far back, which the CPU recipe's does not.
rule train_tiny:
    input:
        engine=lambda wc: engine_input(tiny_builder_engine()),
    output:
        weights=MODELS / "{model}.train" / "model.safetensors",
        manifest=MODELS / "{model}.train" / "wmtp-model.json",
    wildcard_constraints:
        model=generated_names("trained"),
    log:
        MODELS / "{model}.train.log",
    threads: 1
    params:
        python=lambda wc: engine_python_of(tiny_builder_engine()),
        seed=lambda wc: STUDY.model(wc.model).seed,
        out=lambda wc: MODELS / f"{wc.model}.train",
    conda:
        "../envs/pipeline.yaml"
    shell:
        "nice -n 10 {params.python:q} -m wmtp.model.train train --out {params.out:q} --seed {params.seed:q} > {log:q} 2>&1"


# Checkpoints on the Hugging Face Hub: a model with hf_id and path is fetched into path at its pinned revision
# (wmtp.model.hub), its files' sha256 recorded in wmtp-download.json next to them; one that already matches its
# record is not fetched again. A download runs where Snakemake runs (on a cluster, a login node has the network).


rule model:
    localrule: True
    output:
        manifest=f"{{model_path}}/{DOWNLOAD_MANIFEST}",
    wildcard_constraints:
        model_path="|".join(re.escape(path) for path in FETCHED) or "(?!)",
    # Under the study's logs, by the checkpoint's path (never inside the checkpoint, whose files are fingerprinted).
    log:
        LOGS / "models" / "{model_path}.log",
    params:
        py=PY,
        hf_id=lambda wc: FETCHED[wc.model_path].hf_id,
        # Without a pinned revision the default branch is fetched; the record names the commit it resolved to.
        revision=lambda wc: FETCHED[wc.model_path].revision or "main",
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.py} -m wmtp.model.hub --hf-id {params.hf_id:q} --revision {params.revision:q} "
        "--out {wildcards.model_path:q} --log {log:q}"
