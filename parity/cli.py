"""The `parity` command: does the NNX twin compute and shard exactly what Linen does?

    parity CONFIG [key=value ...] [--checks=a,b] [--steps=N] [--json=PATH] [--junit=PATH]
                  [--plot=PATH] [--golden=DIR] [--update_golden]
                  [--num_processes=N [--timeout_s=S] | --coordinator_address=H:P --process_id=I]

Exit 0 when every check passes, 1 when any fails, 2 for usage or config errors (a message, no
traceback); 3 when a local multi-process run lost a worker or timed out (`parity.launch`).
JAX is imported only after the config is read, so that simulated CPU devices can be requested
for the config's mesh first.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from absl import app, flags, logging

from migrate.config import ConfigError, load_config

CHECK_NAMES = (
    "roundtrip",
    "init",
    "forward",
    "grads",
    "sharding",
    "program",
    "pipeline",
    "bubbles",
    "train",
    "layers",
    "compile",
    "efficiency",
)
# Run only when asked (or, for layers, by itself when forward or grads fails). `compile` is the
# one check that never allocates weights: `--checks=compile` works for the 7B config.
ON_REQUEST = ("layers", "compile", "efficiency")

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "checks",
    None,
    f"Checks to run, or 'all' (default: all but {', '.join(ON_REQUEST)}, which runs by "
    f"itself when forward or grads fails). Known: {', '.join(CHECK_NAMES)}.",
)
flags.DEFINE_integer("steps", 5, "Optimizer steps of the train check.", lower_bound=0)
flags.DEFINE_string("json", None, "Write the JSON report here.")
flags.DEFINE_string("junit", None, "Write a JUnit XML report here (one testcase per check).")
flags.DEFINE_string("plot", None, "Write a PNG of the train check's per-step errors here.")
flags.DEFINE_string(
    "golden",
    None,
    "Directory of golden sharding reports: compare with "
    "<DIR>/<model_name>.sharding.json (written when missing).",
)
flags.DEFINE_boolean("update_golden", False, "Rewrite the golden sharding report.")
flags.DEFINE_string(
    "compilation_cache_dir",
    os.environ.get(
        "JAX_COMPILATION_CACHE_DIR", str(Path.home() / ".cache" / "linen-nnx-parity" / "xla")
    ),
    "Persistent XLA compilation cache ('' disables).",
)
flags.DEFINE_integer(
    "num_processes",
    1,
    "Processes of the run (JAX distributed runtime). Without --process_id: launch that many "
    "local workers, each with its share of the mesh as simulated CPU devices.",
    lower_bound=1,
)
flags.DEFINE_integer(
    "process_id",
    None,
    "This process's index in a multi-process run (with --coordinator_address): run as one "
    "worker instead of launching.",
    lower_bound=0,
)
flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0's coordinator (multi-process runs)."
)
flags.DEFINE_float(
    "timeout_s",
    3600.0,
    "Local launcher only: stop every worker and fail when the run takes longer.",
    lower_bound=1.0,
)
# The flags a launcher hands on to its workers (when given on its command line).
WORKER_FLAGS = (
    "checks",
    "steps",
    "json",
    "junit",
    "plot",
    "golden",
    "update_golden",
    "compilation_cache_dir",
    "num_processes",
)

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


def progress(message: str) -> None:
    print(f"[parity] {message}", file=sys.stderr, flush=True)


def _select_checks() -> list[str] | str:
    if FLAGS.checks == ["all"]:
        return list(CHECK_NAMES)
    selected = FLAGS.checks or [c for c in CHECK_NAMES if c not in ON_REQUEST]
    unknown = [c for c in selected if c not in CHECK_NAMES]
    if unknown:
        return f"unknown checks {unknown}; known: {', '.join(CHECK_NAMES)}"
    return selected


def run(argv: Sequence[str]) -> int:
    """The command body; returns the exit status."""
    positional = list(argv[1:])
    if not positional:
        return usage_error("missing CONFIG (for example configs/llama2-tiny.yml)")
    try:
        cfg = load_config(positional[0], positional[1:])
    except ConfigError as e:
        return usage_error(str(e))
    selected = _select_checks()
    if isinstance(selected, str):
        return usage_error(selected)
    processes = FLAGS.num_processes
    if cfg.num_devices % processes:
        return usage_error(
            f"--num_processes={processes} does not divide the mesh's {cfg.num_devices} devices"
        )
    if processes > 1 and FLAGS.process_id is None and FLAGS.coordinator_address is None:
        from parity import launch  # the local launcher never imports JAX

        args = [*positional, *(FLAGS[n].serialize() for n in WORKER_FLAGS if FLAGS[n].present)]
        return launch.launch(args, processes, cfg.num_devices // processes, FLAGS.timeout_s)
    if processes > 1 and (FLAGS.process_id is None or FLAGS.coordinator_address is None):
        return usage_error("a multi-process worker needs --coordinator_address and --process_id")
    ensure_simulated_devices(cfg.num_devices // processes)

    import jax  # JAX starts here

    from parity import distributed

    if processes > 1:
        distributed.initialize(FLAGS.coordinator_address, processes, FLAGS.process_id)
    if FLAGS.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", FLAGS.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

    from migrate.sharding import MeshError
    from parity import checks, report

    try:
        session = checks.Session(cfg)
    except MeshError as e:
        return usage_error(str(e))
    progress(
        f"{cfg.model_name}: {cfg.num_devices} devices in {processes} process(es), "
        f"S={cfg.num_stages} "
        f"M={cfg.num_microbatches} R={cfg.num_repeats} L={cfg.layers_per_stage}; "
        f"checks: {', '.join(selected)}"
    )
    results, durations = [], []

    def run_check(name: str) -> None:
        start = time.perf_counter()
        progress(f"{name} ...")
        on_step = lambda s, ok: progress(
            f"train step {s + 1}/{FLAGS.steps}: {'ok' if ok else 'DIVERGED'}"
        )
        try:
            if name == "train":
                result = checks.train(session, FLAGS.steps, on_step=on_step)
            else:
                result = checks.CHECKS[name](session)
        except Exception as e:  # a check that cannot even run is a failed check, not a crash
            result = checks.errored(name, e)
        durations.append(time.perf_counter() - start)
        progress(f"{name}: {'PASS' if result.passed else 'FAIL'} ({durations[-1]:.1f}s)")
        results.append(result)

    for name in selected:
        run_check(name)
    drill_down = any(r.name in ("forward", "grads") and not r.passed for r in results)
    if drill_down and "layers" not in selected:
        progress("forward or grads failed: drilling down per layer")
        run_check("layers")

    main = distributed.is_main()  # only process 0 prints the table and writes reports
    if FLAGS.golden:
        results.append(_golden_result(checks, report, session, write=main))
        durations.append(0.0)
    if main:
        report.render_table(results, cfg)
        if FLAGS.json:
            report.write_json(results, cfg, FLAGS.json)
        if FLAGS.junit:
            report.write_junit(results, cfg, FLAGS.junit, durations)
        if FLAGS.plot and not report.write_plot(results, cfg, FLAGS.plot):
            progress("--plot: no train check ran, nothing to plot")
    status = EXIT_PASS if all(r.passed for r in results) else EXIT_FAIL
    return distributed.worst_status(status)


def _golden_result(checks, report, session, write: bool = True):
    path = Path(FLAGS.golden) / f"{session.cfg.model_name}.sharding.json"
    current = report.golden_sharding(session)
    if FLAGS.update_golden or not path.exists():
        if write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
            progress(f"golden sharding report written: {path}")
        return checks.CheckResult(
            "golden", True, "differences", 0.0, 0.0, str(path), message="written"
        )
    differences = report.golden_differences(json.loads(path.read_text()), current)
    for line in differences if write else ():
        print(f"  golden {line}")
    return checks.CheckResult(
        "golden",
        not differences,
        "differences",
        float(len(differences)),
        0.0,
        differences[0] if differences else str(path),
        details=tuple({"difference": d, "passed": False} for d in differences),
        message=f"compared with {path}"
        + ("; rerun with --update_golden to accept" if differences else ""),
    )


def main() -> None:
    """Console-script entry point."""

    def entry(argv: Sequence[str]) -> None:
        logging.set_verbosity(logging.WARNING)
        sys.exit(run(argv))

    app.run(entry, flags_parser=_parse_flags)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, but a bad flag exits 2 (usage error) with a one-line message."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        print(f"parity: error: {e}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


if __name__ == "__main__":
    main()
