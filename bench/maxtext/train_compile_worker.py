"""MaxText 0.2.5's own `train_compile`, run as shipped, with its compiled train step measured.

Runs in MaxText's own virtual environment (`bench/maxtext/install.sh
maxtext.trainers.pre_train.train_compile`), never in the project's:

    DECOUPLE_GCLOUD=TRUE bench/.venv-maxtext/bin/python bench/maxtext/train_compile_worker.py \
        --out /tmp/maxtext-7b.json KEY=VALUE...

It calls `maxtext.trainers.pre_train.train_compile.main` with MaxText's `configs/base.yml` and
the given overrides, unchanged except that its `jit_and_compile` is wrapped to time the call
(jit, lower and compile: what our `compile` check times) and to keep the compiled step, whose
memory analysis, cost analysis and optimised HLO are written to `--out` (JSON) and next to it
(`.hlo`). `--no_donation` drops the donation of the train state, for the side-by-side only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", required=True, help="JSON report; the HLO goes to OUT.hlo")
parser.add_argument("--devices", type=int, default=8)
parser.add_argument("--no_donation", action="store_true")
args, overrides = parser.parse_known_args()

os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import maxtext  # noqa: E402
from maxtext.trainers.pre_train import train_compile  # noqa: E402

measured = {}
shipped_jit_and_compile = train_compile.jit_and_compile


def timed_jit_and_compile(*call_args, **call_kwargs):
    if args.no_donation:
        call_args = list(call_args)
        call_args[7] = ()  # donate_argnums
    start = time.perf_counter()
    compiled = shipped_jit_and_compile(*call_args, **call_kwargs)
    measured["compile_seconds"] = time.perf_counter() - start
    measured["compiled"] = compiled
    return compiled


train_compile.jit_and_compile = timed_jit_and_compile
base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
train_compile.main([sys.argv[0], base, *overrides])

compiled = measured["compiled"]
memory = compiled.memory_analysis()
cost = compiled.cost_analysis()
cost = cost[0] if isinstance(cost, (list, tuple)) else cost
with open(args.out + ".hlo", "w") as f:
    f.write(compiled.as_text())
with open(args.out, "w") as f:
    json.dump(
        {
            "argument_bytes": int(memory.argument_size_in_bytes),
            "temp_bytes": int(memory.temp_size_in_bytes),
            "output_bytes": int(memory.output_size_in_bytes),
            "alias_bytes": int(memory.alias_size_in_bytes),
            "flops": float(cost.get("flops", 0.0)),
            "compile_seconds": measured["compile_seconds"],
            "overrides": overrides,
            "donation": not args.no_donation,
        },
        f,
        indent=1,
    )
