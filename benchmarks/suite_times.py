"""How long the test tiers take on this machine, written where the docs cite it.

    .venv/bin/python benchmarks/suite_times.py [--runs 3] [--full]

Runs the fast tier (``pytest -q -m "not slow"``, the README's developer loop) ``--runs``
times and, with ``--full``, the whole suite (what ``.ci/run`` runs) once; prints each
run's wall time and the median with its spread, and writes docs/measured/suite_times.json
with the commit, the machine and the test counts, and the lines of docs/testing.md that
state them (``--doc-only``: those lines again from the JSON). Nothing else should run
meanwhile.

Goals (issue [7/7] item 13): the fast tier within 3 minutes, the full suite within 20, on
2 cores in a clean clone.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from rollout_balance import commit, machine  # noqa: E402


def timed(args: list[str]) -> dict:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                         capture_output=True, text=True)
    wall = time.perf_counter() - start
    summary = next((line for line in reversed(out.stdout.splitlines()) if re.search(r"\d+ passed", line)), "")
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|deselected|error)", summary)}
    failed = re.findall(r"^FAILED (\S+)", out.stdout, re.M)
    return {"wall_s": round(wall, 1), "returncode": out.returncode, **counts, **({"failed_tests": failed} if failed
                                                                                   else {})}


DOC = ROOT / "docs" / "testing.md"
START, END = "<!-- suite_times: written by benchmarks/suite_times.py -->", "<!-- /suite_times -->"


def write_doc(result: dict, doc: Path = DOC) -> None:
    """The measured lines of docs/testing.md, between its markers, from ``result``."""
    fast = result["fast_tier"]
    walls = ", ".join(f"{r['wall_s']:.0f} s" for r in fast["runs"])
    counts = fast["runs"][-1]
    lines = [START, "",
             f"Measured on {result['commit']} ({result['machine']['cores']} cores, {result['machine']['cpu']}; "
             f"[measured/suite_times.json](measured/suite_times.json)): the fast tier "
             f"({counts.get('passed', 0)} passed, {counts.get('skipped', 0)} skipped) took a median of "
             f"{fast['median_s'] / 60:.1f} minutes over {len(fast['runs'])} runs ({walls}; the goal: 3 minutes)."]
    if "full_suite" in result:
        full = result["full_suite"]["run"]
        lines.append(f"The full suite took {full['wall_s'] / 60:.1f} minutes once ({full.get('passed', 0)} passed; "
                     f"the goal: 20 minutes).")
    lines += ["", END]
    text = doc.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    doc.write_text(head + "\n".join(lines) + tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--full", action="store_true", help="also time the whole suite once")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "measured" / "suite_times.json")
    parser.add_argument("--doc-only", action="store_true", help="write docs/testing.md's lines from --out")
    args = parser.parse_args()
    if args.doc_only:
        write_doc(json.loads(args.out.read_text()))
        return
    fast = []
    for i in range(args.runs):
        fast.append(timed(["-m", "not slow"]))
        print(f"fast tier run {i + 1}: {fast[-1]}", flush=True)
    walls = [r["wall_s"] for r in fast]
    result = {"benchmark": "benchmarks/suite_times.py", "commit": commit(), "machine": machine(),
              "fast_tier": {"command": '.venv/bin/python -m pytest -q -m "not slow"', "runs": fast,
                            "median_s": statistics.median(walls), "min_s": min(walls), "max_s": max(walls),
                            "goal_s": 180}}
    print(f"fast tier: median {result['fast_tier']['median_s']:.0f} s (spread {min(walls):.0f}-{max(walls):.0f} s) "
          f"over {len(walls)} runs; goal 180 s", flush=True)
    if args.full:
        full = timed([])
        result["full_suite"] = {"command": ".venv/bin/python -m pytest -q", "run": full, "goal_s": 1200}
        print(f"full suite: {full}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    write_doc(result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("fast_tier", "full_suite")}))


if __name__ == "__main__":
    main()
