# wmtp: speculative decoding at long context, end to end. The rules are thin; the work is in src/wmtp.
from snakemake.utils import min_version

min_version("9.0")


# A study file is the whole truth: the embedded default applies only when no --configfile names a study,
# so another study never inherits its keys (Snakemake would merge them key by key).
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


include: "rules/common.smk"
include: "rules/study.smk"
include: "rules/models.smk"
include: "rules/engines.smk"
include: "rules/cells.smk"
include: "rules/pieces.smk"
include: "rules/admission.smk"
include: "rules/collect.smk"
include: "rules/replica.smk"
include: "rules/report.smk"


rule all:
    input:
        all_targets(),
    default_target: True
