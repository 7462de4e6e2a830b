"""Count the engine tests in a pytest JUnit report and fail when any was skipped or none ran.

tests/conftest.py tags every test marked ``engine`` with the property ``marker=engine``; this reads
pytest's own report, so a green CI run means the engine proofs ran, not that they were skipped.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def engine_outcomes(report: Path) -> dict[str, int]:
    counts = {"passed": 0, "skipped": 0, "failed": 0}
    for case in ET.parse(report).iter("testcase"):
        props = {(p.get("name"), p.get("value")) for p in case.iter("property")}
        if ("marker", "engine") not in props:
            continue
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: engine_tests.py JUNIT_XML", file=sys.stderr)
        return 2
    report = Path(argv[0])
    if not report.exists():
        print(f"CI: no pytest report at {report}", file=sys.stderr)
        return 1
    counts = engine_outcomes(report)
    print(f"CI: engine tests {counts['passed']} passed, {counts['skipped']} skipped, {counts['failed']} failed")
    if counts["skipped"] or not counts["passed"]:
        print("CI: an engine test was skipped or none ran: the proofs did not run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
