"""Every remat policy MaxText 0.2.5 accepts, on one pipelined shape: the twins' compiled memory
against MaxText's, and whether the two decoders' gradients agree. The table of
docs/performance.md, "Remat policies".

    .venv/bin/python bench/remat_policies.py [--config configs/maxtext/pp4.yml] [--only P,Q]

Each policy is one `parity maxtext CONFIG remat_policy=P --against=twin --checks=grads,compile`
(MaxText 0.2.5's NNX decoder against the NNX twin, each in its own worker, 8 simulated CPU
devices): per device, the train step's forward+backward temp bytes and FLOPs of both sides as
the compile check reads them, and the grads check's verdict. A policy MaxText cannot run is
listed with the first line of its error. Needs MaxText's environments (`make maxtext-envs`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
KIB = 1024.0


def run(config: str, policy: str, scratch: Path) -> dict:
    report = scratch / f"{policy}.json"
    started = time.perf_counter()
    command = [str(ROOT / ".venv/bin/parity"), "maxtext", config, f"remat_policy={policy}"]
    command += ["--against=twin", "--checks=grads,compile", f"--json={report}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    row = {"policy": policy, "exit": done.returncode, "seconds": time.perf_counter() - started}
    if not report.exists():
        row["error"] = (done.stderr.strip().splitlines() or ["no report"])[-1]
        return row
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    for name, check in checks.items():
        row[name] = check["status"]
        if check["status"] not in ("PASS", "FAIL"):
            row["error"] = check["message"].splitlines()[0]
    compiled = {d["tensor"]: d for d in checks.get("compile", {}).get("details", [])}
    for field in ("temp_bytes", "flops"):
        if field in compiled:
            row[field] = (compiled[field]["linen"], compiled[field]["nnx"])
    return row


def main() -> None:
    from migrate.common import remat

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/maxtext/pp4.yml")
    parser.add_argument("--only", help="comma-separated policies (default: every one)")
    args = parser.parse_args()
    policies = args.only.split(",") if args.only else list(remat.POLICIES)
    if unknown := sorted(set(policies) - set(remat.POLICIES)):
        raise SystemExit(f"--only: {', '.join(unknown)}: not a policy ({remat.POLICIES})")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for policy in policies:
            rows.append(run(args.config, policy, Path(scratch)))
            print(f"{policy}: exit {rows[-1]['exit']}", file=sys.stderr, flush=True)
    print(f"{args.config}: per device, forward+backward, 8 simulated CPU devices\n")
    print("| `remat_policy` | twin temp | MaxText temp | MaxText / twin | twin FLOPs | grads |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        if "temp_bytes" not in row:
            print(f"| `{row['policy']}` | | | | | MaxText: {row.get('error', '?')} |")
            continue
        (twin, maxtext), (flops, _) = row["temp_bytes"], row["flops"]
        print(
            f"| `{row['policy']}` | {twin / KIB:.1f} KiB | {maxtext / KIB:.1f} KiB | "
            f"{maxtext / twin:.3f} | {flops:.4g} | {row.get('grads', '?')} |"
        )


if __name__ == "__main__":
    main()
