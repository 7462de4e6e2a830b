"""What a run of an engine's plugin proofs found (scripts/device/*_gpu_proofs.py), written once and said per proof."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: What the proofs print of their findings beside each proof's verdict.
SUMMARY_KEYS = ("engine", "arms", "plugin_counters", "read_set", "poison_writes")


def finish(found: dict[str, Any], outputs: dict[str, Any], path: Path) -> int:
    """Add which code the proofs are of (the commit, and the plugin's source as this process imported it) and the
    verdict to ``found``, write it with the outputs to ``path``, print each proof; 0 when every one passed."""
    from wmtp.measure.cell import git_revision
    from wmtp.plugin import source_sha256

    proofs = found["proofs"]
    found["wmtp_revision"] = git_revision()
    found["wmtp_plugin_sha256"] = source_sha256()
    found["passed"] = all(proofs.values())
    found["outputs"] = outputs
    path.write_text(json.dumps(found, indent=1))
    for name, ok in proofs.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    print(json.dumps({key: found[key] for key in SUMMARY_KEYS if key in found}))
    return 0 if found["passed"] else 1
