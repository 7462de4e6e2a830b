# wmtp: speculative decoding at long context, end to end. The rules are thin; the work is in src/wmtp.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "rules/common.smk"
include: "rules/models.smk"
include: "rules/engines.smk"
include: "rules/cells.smk"
include: "rules/collect.smk"
include: "rules/replica.smk"
include: "rules/report.smk"


rule all:
    input:
        all_targets(),
    default_target: True
