"""The `parity` command: `parity CONFIG [key=value ...] [--checks=a,b] [--json=PATH]`.

Exit 0 when every check passes, 1 when any fails, 2 for usage or config errors.
JAX is imported only after the config is read, so that the simulated CPU device count can be
set from the config's mesh first.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Sequence

from absl import app, flags

from migrate.config import ConfigError, load_config

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "checks", None, "Checks to run (default: all): roundtrip, forward, grads, pipeline."
)
flags.DEFINE_string("json", None, "Write the JSON report here.")

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def ensure_simulated_devices(count: int) -> None:
    """Ask XLA for `count` host devices unless the flags already give enough (before jax)."""
    if "jax" in sys.modules:
        return
    flags_now = os.environ.get("XLA_FLAGS", "")
    found = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags_now)
    if found and int(found.group(1)) >= count:
        return
    flags_now = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags_now).strip()
    os.environ["XLA_FLAGS"] = f"{flags_now} --xla_force_host_platform_device_count={count}".strip()


def usage_error(message: str) -> int:
    print(f"parity: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run(argv: Sequence[str]) -> int:
    """The command body; returns the exit status."""
    positional = list(argv[1:])
    if not positional:
        return usage_error("missing CONFIG (for example configs/llama2-tiny.yml)")
    config_path, overrides = positional[0], positional[1:]
    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as e:
        return usage_error(str(e))
    ensure_simulated_devices(cfg.num_devices)

    from migrate.sharding import MeshError
    from parity import checks, report  # JAX starts here

    available = checks.CHECKS
    selected = FLAGS.checks or list(available)
    unknown = [c for c in selected if c not in available]
    if unknown:
        return usage_error(f"unknown checks {unknown}; known: {', '.join(available)}")
    try:
        session = checks.Session(cfg)
    except MeshError as e:
        return usage_error(str(e))
    results = []
    for name in selected:
        start = time.perf_counter()
        print(f"[parity] {cfg.model_name}: running {name} ...", file=sys.stderr, flush=True)
        result = available[name](session)
        print(
            f"[parity] {name}: {'PASS' if result.passed else 'FAIL'} "
            f"({time.perf_counter() - start:.1f}s)",
            file=sys.stderr,
            flush=True,
        )
        results.append(result)
    report.render_table(results, cfg)
    if FLAGS.json:
        report.write_json(results, cfg, FLAGS.json)
    return EXIT_PASS if all(r.passed for r in results) else EXIT_FAIL


def main() -> None:
    """Console-script entry point."""
    app.run(lambda argv: sys.exit(run(argv)))


if __name__ == "__main__":
    main()
