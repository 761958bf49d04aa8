"""The `parity` command: does the NNX twin compute and shard exactly what Linen does?

    parity CONFIG [key=value ...] [--checks=a,b] [--steps=N] [--json=PATH] [--junit=PATH]
                  [--plot=PATH] [--golden=DIR [--update_golden] [--[no]require_golden]]
                  [--nomemory_check] [--verbose] [--version]
                  [--num_processes=N [--timeout_s=S] | --coordinator_address=H:P --process_id=I]
                  [--init_timeout_s=S] [--checkpoint=DIR] [--compilation_cache_dir=DIR] [--dry_run]
                  [--linen_python=PY] [--nnx_python=PY] [--linen_path=DIR] [--nnx_path=DIR]
    parity maxtext configs/maxtext/NAME.yml [key=value ...] [--against=twin] [--topology=NAME]
                  [--linen_python=PY] [--nnx_python=PY]    (also spelled parity --maxtext CONFIG)

Exit statuses (`migrate.errors`, the largest applies): `EXIT_STATUSES`, in `--help`. The checks
are the registry's (`parity.engine.registry`); the flags are parsed here, once, into
`parity.run_options.RunOptions`: nothing below this module reads absl.

Longer than 500 lines: the front door is one job (the flags, read once; both modes' validation
before JAX; the run of each mode), and every line past it would move absl below the door.

Everything that needs no JAX is validated first: the config (bounds), the checks, the
multi-process flags, the output paths and the golden file (`parity.run_inputs`), the work of
unrolled loops, and the memory the run needs at least. JAX is
imported only then, after the simulated CPU devices for the config's mesh were requested.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import app, flags, logging

from migrate import errors
from migrate.checkpoints import meta
from migrate.config.loading import base_config_path, load_config, resolve
from migrate.errors import EXIT_FAIL, EXIT_INTERNAL, EXIT_PASS, EXIT_USAGE, BadInput
from migrate.runtime import cli_help, cli_support, memory
from migrate.runtime.devices import ensure_simulated_devices
from parity import run_inputs  # no JAX
from parity.engine import registry  # no JAX
from parity.engine.registry import Front, Need
from parity.multiprocess import coordinator  # no JAX
from parity.remote import environments as remote_environments  # no JAX
from parity.reports import report, run_facts  # no JAX
from parity.reports.outputs import Outputs
from parity.reports.progress import plan, progress, workers_line
from parity.run_options import Mode, RunOptions

FLAGS = flags.FLAGS
_ABSL_FLAGS = set(FLAGS)  # absl's own (--helpfull lists them): not this command's
flags.DEFINE_list(
    "checks",
    None,
    f"Checks to run, comma-separated, or 'all'. (default: every check but "
    f"{', '.join(registry.on_request(Front.TWINS))}; layers runs by itself when forward or "
    "grads fails)",
)
flags.DEFINE_integer(
    "steps",
    5,
    "Optimizer steps of the train check; with --maxtext, also the steps MaxText 0.2.3's "
    "train.py trains before the checkpoint check's checkpoint (3 when not given).",
    lower_bound=0,
)
flags.DEFINE_string("json", None, "Write the JSON report here.")
flags.DEFINE_string("junit", None, "Write a JUnit XML report here (one testcase per check).")
flags.DEFINE_string(
    "plot",
    None,
    "Write the train check's per-step losses and errors here, as the image its extension names: "
    ".png (or none), .jpg/.jpeg, .svg, .pdf; any other is refused. Needs the train check.",
)
flags.DEFINE_string(
    "golden",
    None,
    "Directory of golden sharding reports: compare with "
    "<DIR>/<model_name>.sharding.json (the model name made a safe file name; a missing one is "
    "written, said in a progress line and the check's note, unless --require_golden). The "
    "twins' only: refused with --maxtext.",
)
flags.DEFINE_boolean("update_golden", False, "Rewrite the golden sharding report.")
flags.DEFINE_boolean(
    "require_golden",
    None,
    "A missing golden file is bad input (exit 2) instead of written. Default: on when the "
    "environment sets CI=true (a wrong --golden path in CI must not pass); --norequire_golden "
    "writes it there too.",
)
flags.DEFINE_string(
    "compilation_cache_dir",
    os.environ.get(
        "JAX_COMPILATION_CACHE_DIR", str(Path.home() / ".cache" / "linen-nnx-parity" / "xla")
    ),
    "Persistent XLA compilation cache ('': none kept; the run compiles through its own, deleted "
    "at exit, so that identical programs compile once).",
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
flags.DEFINE_float(
    "init_timeout_s",
    120.0,
    "Multi-process runs: exit 3 when the coordinator cannot be reached, or not every process "
    "joined, within this many seconds.",
    lower_bound=1.0,
    upper_bound=86400.0,
)
flags.DEFINE_boolean(
    "memory_check",
    True,
    "Refuse (exit 2) a config whose lower-bound memory estimate exceeds the available memory.",
)
flags.DEFINE_string(
    "checkpoint",
    None,
    "Run the checks on the weights of this checkpoint (written by `migrate`; either twin, "
    "either layout) instead of the twins' own initialisations: the config takes the "
    "checkpoint's recorded layout keys and weight dtype.",
)
for _side in ("linen", "nnx"):
    flags.DEFINE_string(
        f"{_side}_python",
        None,
        f"Run the {_side} side in a worker process started with this interpreter (another "
        "environment; the other side then runs in a worker of its own, with this one's "
        "interpreter unless given).",
    )
    flags.DEFINE_string(
        f"{_side}_path",
        None,
        f"The checkout whose migrate/ and parity/ the {_side} side's worker imports (another "
        "version of the code: gate before/after a change).",
    )
flags.DEFINE_boolean(
    "maxtext",
    False,
    "As `parity maxtext CONFIG`: CONFIG is a MaxText gate config (configs/maxtext/): MaxText's "
    "own Linen decoder (0.2.3, "
    "--linen_python) against its NNX decoder (0.2.5, --nnx_python), each built by its release "
    "from the config's MaxText keys (defaults: the environments of `make maxtext-envs`).",
)
flags.DEFINE_enum(
    "against",
    "release",
    ["release", "twin"],
    "With --maxtext: the side MaxText 0.2.5's NNX decoder is held to: its Linen release 0.2.3 "
    "(release), or this project's NNX twin of the config's llama2 shape (twin: "
    "parity/maxtext/twin_gate.py).",
)
flags.DEFINE_float(
    "worker_timeout_s", 600.0, "Each call to a worker must answer within this.", lower_bound=1
)
flags.DEFINE_string(
    "topology",
    None,
    "Compile the compile and program checks' train steps for this TPU slice, by MaxText's "
    "names (v5e-8, "
    "v5p-16, ...), from this host (libtpu: `pip install jax[tpu]`), instead of for the CPU: "
    "per-device memory against the chip's HBM. The config's mesh must have the slice's "
    "devices (times --num_slices).",
)
flags.DEFINE_integer(
    "num_slices",
    None,
    "With --topology: the slices (default: the config's, dcn_data_parallelism x "
    "dcn_pipeline_parallelism; must equal them).",
    lower_bound=1,
)
flags.DEFINE_boolean("verbose", False, "Print internal errors' tracebacks and compiler warnings.")
flags.DEFINE_boolean(
    "dry_run",
    False,
    "Validate the config, flags, output paths and memory estimate, print the plan, and exit 0 "
    "without starting JAX or running a check.",
)
OWN_FLAGS = tuple(sorted(set(FLAGS) - _ABSL_FLAGS))
# The flags a launcher hands on to its workers (when given on its command line).
WORKER_FLAGS = (
    "checks",
    "steps",
    "json",
    "junit",
    "plot",
    "golden",
    "update_golden",
    "require_golden",
    "compilation_cache_dir",
    "num_processes",
    "init_timeout_s",
    "memory_check",
    "verbose",
)
EXIT_WORKER = errors.EXIT_WORKER
EXIT_STATUSES = (
    ("0", "every check passed"),
    ("1", "a check failed: a real parity difference"),
    (
        "2",
        "bad input: usage, config, output path, golden file, too little memory, a check that "
        "could not run on this input, a report that could not be written",
    ),
    (
        "3",
        "a lost worker (another process, or a side in another environment that died or "
        "hung), an unreachable coordinator, a multi-process run that timed out",
    ),
    ("4", "an internal error: the tool or a check crashed (--verbose: the traceback)"),
    ("128+N", "stopped by signal N (130 SIGINT, 143 SIGTERM)"),
)
__all__ = ["EXIT_FAIL", "EXIT_INTERNAL", "EXIT_PASS", "EXIT_USAGE", "EXIT_WORKER", "main", "run"]


def usage_error(message: str) -> int:
    return cli_support.error_line("parity", message)


def options(positional: list[str]) -> tuple[RunOptions, list[str]]:
    """The flags as `RunOptions` (read once, here), and the positional arguments without the
    `maxtext` subcommand that set its mode."""
    maxtext = bool(positional) and positional[0] == Mode.MAXTEXT.name.lower()
    if maxtext:
        positional = positional[1:]
    values = {name: FLAGS[name].value for name in OWN_FLAGS}
    given = frozenset(name for name in OWN_FLAGS if FLAGS[name].present)
    mode = Mode.MAXTEXT if maxtext or FLAGS.maxtext else Mode.TWINS
    return RunOptions.of(values, given, mode), positional


def run(argv: Sequence[str]) -> int:
    """The command body; returns the exit status. Bad input anywhere gives a one-line message
    and EXIT_USAGE; other exceptions reach `cli_support.guarded` (in `main`)."""
    try:
        return _run(argv)
    except BadInput as e:
        return usage_error(str(e))


def _run(argv: Sequence[str]) -> int:
    opts, positional = options(list(argv[1:]))
    if not positional:
        return usage_error("missing CONFIG (for example configs/llama2-tiny.yml)")
    cache = opts.compilation_cache_dir if opts.present("compilation_cache_dir") else ""
    if cache and (why := cli_support.unwritable_reason(Path(cache).expanduser())):  # as given
        return usage_error(f"--compilation_cache_dir={cache}: {why}")  # (a default: uncached)
    if opts.mode is Mode.MAXTEXT:
        return _run_maxtext(opts, positional)
    if opts.present("against"):
        return usage_error("--against: only with --maxtext (`parity maxtext CONFIG`)")
    stored, adjusted = None, []
    path = resolve(positional[0])  # a shipped config's name: its file, for workers too
    if opts.checkpoint is None:
        cfg = load_config(path, positional[1:])
        progress(f"config {path} over {base_config_path(path)}")
        weights = {"source": "init", "seed": cfg.seed}
    else:  # overrides and the checkpoint's layout applied as `migrate` applies them
        if opts.num_processes > 1:
            return usage_error("--checkpoint runs in one process (--num_processes=1)")
        stored = meta.read_meta(opts.checkpoint)  # validated before its keys are used
        cfg, adjusted = run_inputs.checkpoint_config(path, positional[1:], stored)
        weights = run_inputs.checkpoint_weights(opts.checkpoint, stored)
    facts = run_facts.twins_facts(
        path, base_config_path(path), positional[1:], cfg, weights, adjusted
    )
    selected = run_inputs.select_checks(opts, Front.TWINS)
    if isinstance(selected, str):
        return usage_error(selected)
    if not_here := [c for c in selected if not registry.get(c).runs_on(Front.TWINS)]:
        return usage_error(f"--checks: {', '.join(not_here)}: only with `parity maxtext CONFIG`")
    # validated before JAX; another checkout must hold the twins' worker factory
    environments = remote_environments.from_options(
        opts.sides, opts.num_processes, opts.checkpoint, ["parity/decoder/remote_twins.py"]
    )
    if environments is not None:
        local_only = registry.needing(Need.IN_PROCESS, selected)
        if local_only:
            progress(f"not across processes, skipped: {', '.join(local_only)}")
        selected = [c for c in selected if c not in local_only]
        if not selected:  # nothing to run in the workers: refused before they start
            return usage_error(f"--checks: {', '.join(local_only)} need the twins in this process")
    processes = opts.num_processes
    coordinator.check_process_flags(cfg, processes, opts.process_id, opts.coordinator_address)
    from parity.tpu import topologies  # no JAX

    elsewhere = environments is not None or processes > 1
    target = topologies.twins_target(cfg, selected, elsewhere, opts.topology, opts.num_slices)
    run_inputs.check_work(opts, cfg, selected)
    reports = opts.process_id in (None, 0)  # only process 0 writes reports
    # creates report folders
    outputs = run_inputs.outputs(opts, cfg.model_name, selected) if reports else None
    if opts.dry_run:
        on = f"; compile for {target.describe()}" if target is not None else ""
        print(f"{plan(cfg, selected, processes)}{on}; memory {memory.estimate(cfg).describe()}")
        return EXIT_PASS
    if processes > 1 and opts.process_id is None:
        from parity.multiprocess import launch  # the local launcher never imports JAX

        args = [*positional, *(FLAGS[n].serialize() for n in WORKER_FLAGS if opts.present(n))]
        return launch.launch(args, processes, cfg.num_devices // processes, opts.timeout_s)
    ensure_simulated_devices(cfg.num_devices // processes)

    from parity.multiprocess import distributed  # JAX starts here

    if processes > 1:
        distributed.initialize(
            opts.coordinator_address, processes, opts.process_id, opts.init_timeout_s
        )
    from parity.decoder.session import DecoderPair
    from parity.engine import compiles, run_loop
    from parity.engine.result import EXIT_STATUS

    compiles.use_compilation_cache(opts.compilation_cache_dir)
    compiles.echo_partitioner_warnings(opts.verbose)

    if environments is not None:
        from parity.decoder import remote_twins

        pair = remote_twins.RemoteDecoderPair(cfg, path, positional[1:], environments)
        progress(f"sides in workers: {pair.workers.describe(environments)}")
    else:
        pair = DecoderPair(cfg, topology=target)
    if stored is not None:
        from migrate.checkpoints import checkpoint_io, train_state

        spec = train_state.Spec(stored["framework"], stored["layout"], cfg)
        state = checkpoint_io.restore(opts.checkpoint, spec, pair.mesh, stored)
        pair.use_weights(spec.framework, state.params, label="checkpoint")
        progress(
            f"weights from {opts.checkpoint}: {spec.describe()}, step {state.step} (records "
            "name them checkpoint/...)"
        )
    progress(plan(cfg, selected, processes))
    main = distributed.is_main()  # only process 0 prints the table and writes reports
    golden = []
    if outputs is not None and outputs.golden is not None:
        from parity.decoder.golden import golden_result

        golden = [("golden", lambda: golden_result(pair, outputs, write=main))]
    try:  # the sides' workers stop however the checks end (a lost worker, an interrupt)
        drill_down = environments is None
        results, costs = run_loop.run_checks(pair, selected, opts.steps, drill_down, golden)
        if environments is not None:
            progress(workers_line(*pair.workers.call_and_transfer_seconds()))
    finally:
        if environments is not None:
            pair.workers.close()
    status = max(EXIT_STATUS[r.status] for r in results)
    if main:  # a report that cannot be written is exit 2 (the verdict still printed)
        status = max(status, _report(results, cfg.model_name, costs, facts, outputs, {}))
    return distributed.worst_status(status)


def _run_maxtext(opts: RunOptions, positional: Sequence[str]) -> int:
    """`parity maxtext CONFIG`: MaxText's two releases, each in its worker. Everything that
    needs no worker is refused first: the flags it does not take, the config's bounds, the
    checks, the memory both workers need at least, the environments, the output paths."""
    from parity.maxtext import gate_config, gate_memory

    if opts.golden is not None or opts.update_golden:
        return usage_error(
            "--golden/--update_golden: golden sharding reports are the twins' (parity CONFIG), "
            "not with --maxtext (`parity maxtext`)"
        )
    path = resolve(positional[0], "maxtext")
    config = gate_config.load(path, positional[1:], opts.topology, opts.num_slices)
    progress(f"config {path} over {base_config_path(path, 'maxtext')}")
    against_twin = opts.against == "twin"
    if opts.topology is not None:
        front = Front.MAXTEXT_SLICE
    else:
        front = Front.MAXTEXT_TWIN if against_twin else Front.MAXTEXT
    selected = run_inputs.select_checks(opts, Front.MAXTEXT)  # `--checks=` refused too
    if isinstance(selected, str):
        return usage_error(selected)
    target = gate_config.tpu_target(config, selected, opts.topology, opts.num_slices)
    selected, skipped = gate_config.runnable(selected, front)  # BadInput when none can run
    if target is not None and against_twin:
        return usage_error("--topology with --maxtext compiles the two releases: not --against")
    checkpoint_steps = gate_config.CHECKPOINT_STEPS
    if "checkpoint" in selected and opts.present("steps"):
        if opts.steps < 1:
            return usage_error(
                f"--steps={opts.steps}: the checkpoint check trains at least one step before "
                "it checkpoints"
            )
        checkpoint_steps = opts.steps
    if skipped:
        progress(f"not with --maxtext (the twins' checks), skipped: {', '.join(skipped)}")
    estimate = gate_memory.estimate(config) if target is None else None  # nothing allocated
    if opts.memory_check and estimate is not None:
        memory.check_fits(estimate, 1.0, f"--maxtext {positional[0]} (both releases' workers)")
    environments = gate_config.environments(opts)
    if target is not None:
        gate_config.check_tpu_environments(environments)
    outputs = run_inputs.outputs(opts, config.model_name, selected)
    if opts.dry_run and target is not None:
        on = f"each release's train_compile for {target.describe()}"
        print(f"{config.describe()}; checks: compile, {on}")
        return EXIT_PASS
    if opts.dry_run:
        trained = (
            f"; checkpoint after {checkpoint_steps} steps of 0.2.3's train.py"
            if "checkpoint" in selected
            else ""
        )
        checks, memory_line = ", ".join(selected), gate_memory.describe(config, estimate)
        print(f"{config.describe()}; checks: {checks}{trained}; {memory_line}")
        return EXIT_PASS
    if gate_memory.large(estimate):
        from parity.remote.client import WAIT_LINE_S

        assert estimate is not None
        progress(
            f"{config.model_name}: {memory.gib(estimate.parameters)} of parameters per release; "
            "each worker builds its model before the first check (minutes), a line every "
            f"{WAIT_LINE_S:.0f} s while a call to it runs"
        )
    ensure_simulated_devices(config.num_devices)

    from parity.engine import compiles  # JAX starts here
    from parity.engine.result import EXIT_STATUS
    from parity.maxtext import release_pair

    compiles.use_compilation_cache(opts.compilation_cache_dir)  # the workers compile through it
    if target is not None:
        from parity.maxtext import tpu_gate

        results, costs, sides = tpu_gate.run_on_slice(config, environments, target)
    elif against_twin:
        from parity.maxtext import twin_gate

        results, costs, sides = twin_gate.run_gate(config, environments, selected, opts.steps)
    else:
        results, costs, sides = release_pair.run_gate(
            config, environments, selected, opts.steps, checkpoint_steps
        )
    status = max(EXIT_STATUS[r.status] for r in results)
    extra = {"sides": sides, "mesh": config.mesh, "mesh_filled": list(config.filled)}
    facts = run_facts.maxtext_facts(path, base_config_path(path, "maxtext"), positional[1:], config)
    return max(status, _report(results, config.model_name, costs, facts, outputs, extra))


def _report(
    results: Sequence[Any],
    name: str,
    costs: Sequence[dict[str, Any]],
    facts: run_facts.RunFacts,
    outputs: Outputs | None,
    extra: dict[str, Any],
) -> int:
    """The verdict table, the report files (`outputs`: None writes none), then the verdict
    line with the status of the reports; the reports' exit status."""
    report.render_table(results, facts.title(name), costs=costs, verdict=False)
    written = errors.EXIT_PASS
    if outputs is not None:
        written = outputs.write(results, name, costs, {**extra, "run": facts.as_json()})
    print(report.verdict_line(results, written), flush=True)
    return written


def main() -> None:
    """Console-script entry point: every exception becomes its exit status (`migrate.errors`),
    with one line on stderr (and the traceback under --verbose)."""

    def entry(argv: Sequence[str]) -> None:
        logging.set_verbosity(logging.WARNING)
        verbose = lambda: FLAGS["verbose"].value
        if not verbose():
            cli_support.quiet_library_tracebacks()
        status = cli_support.guarded("parity", lambda: run(argv), verbose)
        worker = FLAGS["process_id"].value is not None
        cli_support.exit_now(status, distributed=worker, program="parity")

    app.run(entry, flags_parser=_parse_flags)


def help_text() -> str:
    """`parity --help`: usage, the checks, this command's flags with defaults, exit statuses."""
    title, usage = __doc__.split("\n\n")[:2]
    requested = ", ".join(registry.on_request(Front.TWINS))
    on_request = f" (on request: {requested}; --checks=all runs every one)"
    twins = set(registry.names(Front.TWINS))
    maxtext_only = [(n, h) for n, h in registry.help_lines(Front.MAXTEXT) if n not in twins]
    return cli_help.help_text(
        title,
        usage,
        [
            ("checks" + on_request, registry.help_lines(Front.TWINS)),
            ("parity maxtext CONFIG also runs", maxtext_only),
        ],
        FLAGS,
        OWN_FLAGS,
        EXIT_STATUSES,
    )


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, but a bad flag exits 2 (usage error) with a one-line message, `--help`
    prints this command's own page (absl's lists the flags of the script wrapper), and
    `--version` the versions."""
    if cli_help.wants_help(argv):
        print(help_text())
        sys.exit(EXIT_PASS)
    if cli_help.wants_version(argv):
        print(cli_help.version_text("parity"))
        sys.exit(EXIT_PASS)
    try:
        return FLAGS(argv)
    except flags.Error as e:
        usage_error(str(e))
        sys.exit(EXIT_USAGE)


if __name__ == "__main__":
    main()
