"""The `migrate` command: convert Orbax checkpoints between the Linen and NNX twins and layouts.

    migrate convert --config=CONFIG --from=linen|nnx --to=nnx|linen SRC DST [key=value ...]
            [--layout=pipeline|reference] [--dtype=float32|bfloat16] [--force] [--verify]
            [--verify_forward]
    migrate convert --config=CONFIG --from=maxtext --to=linen|nnx RUN/checkpoints/N DST [...]
    migrate convert --config=CONFIG --from=linen|nnx --to=maxtext SRC ROOT [...] (ROOT/N/items)
    migrate compare --config=CONFIG A B [key=value ...]  (any two: twins, MaxText 0.2.3/0.2.5)
    migrate init --config=CONFIG --framework=linen|nnx DST [key=value ...]
            [--layout=pipeline|reference] [--force]
    migrate port MODULE:CLASS --inputs=SPEC [--out=DIR] [--call_kwargs=K=V,...;...]
            [--names=linen|snake] [--fields_from=MODULE:FUNCTION] [--method=NAME] [--force]
    (either: --verbose prints the traceback of an internal error; COMMAND --help: its help;
    --version: the versions)

`key=value` overrides use MaxText key names. Layout keys among them (ici_pipeline_parallelism,
dcn_pipeline_parallelism, num_layers_per_pipeline_stage, num_pipeline_repeats,
scan_layers_per_stage) re-stage the destination; the source keeps the layout it records. Exit
status (`migrate.errors`): 0 written, 1 verification failed (nothing written), 2 usage, config,
checkpoint, path or resource error (a message, no traceback; the destination untouched), 4 an
internal error, 128+N stopped by signal N (the staging directory removed). `--force` replaces
only a checkpoint this tool wrote (`migrate.checkpoints.destination`).

Flags live in their own `FlagValues`, so this module and `parity.cli` share a process freely.
JAX is imported only after the config is read, once the simulated device count is known.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from absl import flags, logging

from migrate.checkpoints import destination, forward_check
from migrate.checkpoints.meta import read_meta
from migrate.config.contract import Config, ConfigError
from migrate.config.loading import load_config, parse_overrides, with_changes
from migrate.errors import EXIT_FAIL, EXIT_INTERNAL, EXIT_PASS, EXIT_USAGE, BadInput
from migrate.runtime import cli_help, cli_support, memory
from migrate.runtime.devices import DEFAULT_DEVICES, ensure_simulated_devices

COMMANDS = ("convert", "init", "compare", "port")
FRAMEWORKS = ("linen", "nnx")
KINDS = (*FRAMEWORKS, "maxtext")  # convert: a MaxText checkpoint on either side
LAYOUTS = ("pipeline", "reference")
DTYPES = ("float32", "bfloat16")
EXIT_OK, EXIT_VERIFY_FAILED = EXIT_PASS, EXIT_FAIL
__all__ = ["EXIT_INTERNAL", "EXIT_OK", "EXIT_USAGE", "EXIT_VERIFY_FAILED", "main", "run"]

FLAGS = flags.FlagValues()
flags.DEFINE_string("config", None, "Model config YAML (over configs/base.yml).", flag_values=FLAGS)
flags.DEFINE_enum(
    "from", None, KINDS, "convert: the source's framework (maxtext: a MaxText step directory).",
    flag_values=FLAGS,
)  # fmt: skip
flags.DEFINE_enum(
    "to", None, KINDS, "convert: the destination's framework (maxtext: a checkpoints root).",
    flag_values=FLAGS,
)  # fmt: skip
flags.DEFINE_enum("framework", None, FRAMEWORKS, "init: the framework.", flag_values=FLAGS)
flags.DEFINE_enum(
    "layout",
    None,
    LAYOUTS,
    "Destination layout (convert: default the source's; init: pipeline when S > 1).",
    flag_values=FLAGS,
)
flags.DEFINE_enum(
    "dtype",
    None,
    DTYPES,
    "convert: cast weights and optimizer moments to this dtype (otherwise a dtype change is an "
    "error).",
    flag_values=FLAGS,
)
flags.DEFINE_boolean(
    "force",
    False,
    "Replace an existing destination (port: only files it wrote itself).",
    flag_values=FLAGS,
)
flags.DEFINE_string(
    "inputs",
    None,
    "port: example inputs, one DTYPE[SHAPE] per positional argument, `;` between them "
    "(float32[4,8];int32[4]).",
    flag_values=FLAGS,
)
flags.DEFINE_string(
    "out", ".", "port: the folder the port's files are written to.", flag_values=FLAGS
)
flags.DEFINE_string(
    "call_kwargs",
    None,
    "port: literal keyword arguments of each call the port is traced and gated with "
    "(train=False;train=True: two calls).",
    flag_values=FLAGS,
)
flags.DEFINE_enum(
    "names",
    "linen",
    ("linen", "snake"),
    "port: the port's attribute names: Linen's own (Dense_0, the weight map the identity) or "
    "snake_case (dense_0, renames in the weight map).",
    flag_values=FLAGS,
)
flags.DEFINE_string(
    "fields_from",
    None,
    "port: MODULE:FUNCTION returning the fields the module is built with, where they are not "
    "literals (a config, a mesh); the written gate calls it too.",
    flag_values=FLAGS,
)
flags.DEFINE_string(
    "method",
    None,
    "port: the method the trace and the gate call (default __call__), for a module called "
    "through another one (encode, decode).",
    flag_values=FLAGS,
)
flags.DEFINE_boolean(
    "verify",
    False,
    "convert: before moving the result into place, restore both sides and compare bit for bit.",
    flag_values=FLAGS,
)
flags.DEFINE_boolean(
    "verify_forward",
    False,
    "convert: also run the parity `forward` check (NNX vs Linen logits and loss) on the "
    "converted weights before moving them into place.",
    flag_values=FLAGS,
)
flags.DEFINE_boolean(
    "memory_check",
    True,
    "Refuse (exit 2) a checkpoint whose lower-bound memory estimate exceeds the available memory.",
    flag_values=FLAGS,
)
flags.DEFINE_boolean(
    "verbose", False, "Print the traceback of an internal error.", flag_values=FLAGS
)

USAGE = __doc__.split("\n\n")[1]


def usage_error(message: str) -> int:
    return cli_support.error_line("migrate", message)


def progress(message: str) -> None:
    print(f"[migrate] {message}", file=sys.stderr, flush=True)


def target_config(cfg: Config, changes: Mapping[str, Any], src: str | None) -> Config:
    """The destination's config, before JAX: the config, then the layout keys that the source's
    `meta` records (read and validated: a missing, corrupt or edited meta is refused here), then
    the `changes`, validated together as the command will build them."""
    if src is None:
        return with_changes(cfg, changes)
    try:
        return with_changes(cfg, {**read_meta(src)["layout_keys"], **changes})
    except ConfigError as e:
        raise ConfigError(f"the layout asked for is invalid: {e}") from None


def _summary(outcome, src: str | None, dst: str) -> None:
    if outcome.source is not None:
        print(f"from {src}: {outcome.source.describe()}, step {outcome.step}")
    print(f"to   {dst}: {outcome.target.describe()}, step {outcome.step}")
    print(
        f"     {outcome.arrays} arrays, {outcome.nbytes / 2**20:,.1f} MiB "
        "(parameters and optimizer state)"
    )
    for check in outcome.checks:
        print(f"     checked before writing: {check}")


def run(argv: Sequence[str]) -> int:
    """The command body (flags already parsed into `FLAGS`); returns the exit status (bad
    input: a message and EXIT_USAGE; other exceptions propagate to `cli_support.guarded`)."""
    try:
        return _run(argv)
    except BadInput as e:
        return usage_error(str(e))


def _run(argv: Sequence[str]) -> int:
    args = list(argv[1:])
    if not args or args[0] not in COMMANDS:
        got = f" {args[0]!r}" if args else ""
        return usage_error(
            f"expected a command, convert, init, compare or port, got{got or ' none'}\n{USAGE}"
        )
    command, positional = args[0], args[1:]
    if command == "port":
        return _port(positional)
    count = 1 if command == "init" else 2
    if not FLAGS.config:
        return usage_error("--config is required (for example --config=configs/llama2-tiny.yml)")
    if len(positional) < count or any("=" in p for p in positional[:count]):
        expected = "SRC DST" if count == 2 else "DST"
        return usage_error(
            f"{command}: expected {expected}, then key=value overrides; got {positional}"
        )
    # Absolute from here on (against the working directory, symlinks kept): Orbax refuses a
    # relative path, and every message then names the place unambiguously.
    paths = [str(Path(p).absolute()) for p in positional[:count]]
    overrides = positional[count:]
    source, target = (FLAGS["from"].value, FLAGS.to)
    if command == "convert" and (source is None or target is None):
        return usage_error("convert: --from and --to are required (linen or nnx)")
    if command == "compare" or "maxtext" in (source, target):
        return _maxtext(command, paths, load_config(FLAGS.config), parse_overrides(overrides))
    if command == "init" and FLAGS.framework is None:
        return usage_error("init: --framework is required (linen or nnx)")
    cfg = load_config(FLAGS.config)
    changes = parse_overrides(overrides)
    src = paths[0] if command == "convert" else None
    # Everything that needs no JAX is refused before JAX starts: the destination, the
    # source's meta, the mesh the result needs.
    destination.check_destination(
        Path(src) if src is not None else None, Path(paths[-1]), FLAGS.force
    )
    target_cfg = target_config(cfg, changes, src)
    if FLAGS.memory_check:
        both = command == "convert" and (FLAGS.verify or FLAGS.verify_forward)
        needed = memory.estimate(target_cfg, copies=2 if both else 1, gradients=False)
        memory.check_fits(needed, what=f"{command} {paths[-1]}")
    ensure_simulated_devices(target_cfg.num_devices)

    from migrate.checkpoints import commands as checkpoint
    from migrate.checkpoints import train_state
    from migrate.checkpoints.convert import ConversionError
    from migrate.common.layout import LayoutError

    try:
        if command == "init":
            spec_cfg = with_changes(cfg, changes)
            layout = FLAGS.layout or ("pipeline" if spec_cfg.using_pipeline else "reference")
            spec = train_state.Spec(FLAGS.framework, layout, spec_cfg)
            outcome = checkpoint.init_checkpoint(paths[0], spec, FLAGS.force)
        else:
            forward = functools.partial(
                forward_check.problems, config=FLAGS.config, overrides=overrides,
                verbose=FLAGS.verbose, say=progress,
            )  # fmt: skip
            checks = {"forward": forward} if FLAGS.verify_forward else {}
            outcome = checkpoint.convert_checkpoint(
                paths[0],
                paths[1],
                cfg,
                source,
                target,
                layout=FLAGS.layout,
                changes=changes,
                dtype=FLAGS.dtype,
                force=FLAGS.force,
                verify=FLAGS.verify,
                checks=checks,
            )
    except (ConversionError, LayoutError) as e:  # the checkpoint does not fit: bad input
        return usage_error(str(e))
    if outcome.differences:
        print(
            f"migrate: verification failed; {paths[-1]} was not written:\n"
            + "\n".join(f"  - {d}" for d in outcome.differences),
            file=sys.stderr,
        )
        return EXIT_VERIFY_FAILED
    _summary(outcome, src, paths[-1])
    return EXIT_OK


def _port(positional: Sequence[str]) -> int:
    """`migrate port MODULE:CLASS --inputs=SPEC`: the NNX port written and gated
    (`migrate.port.command`): 0 its gate passes, 1 it fails, 2 bad input."""
    if len(positional) != 1:
        return usage_error(f"port: expected MODULE:CLASS, got {list(positional)}")
    if not FLAGS.inputs:
        return usage_error("port: --inputs is required (e.g. --inputs=float32[4,8])")
    from migrate.port import spec

    # Everything the command line says is checked before JAX starts.
    spec.parse_target(positional[0])
    spec.parse_inputs(FLAGS.inputs)
    spec.parse_call_kwargs(FLAGS.call_kwargs)
    if FLAGS.fields_from is not None:
        spec.check_fields_from(FLAGS.fields_from, positional[0])
    # A module built on a mesh (through --fields_from) finds the project's simulated devices.
    ensure_simulated_devices(DEFAULT_DEVICES)
    from migrate.port import command as port_command

    return port_command.run_command(
        positional[0], FLAGS.inputs, FLAGS.out, FLAGS.call_kwargs, FLAGS.names, FLAGS.force,
        FLAGS.fields_from, FLAGS.method,
    )  # fmt: skip


def _maxtext(command: str, paths: list[str], cfg: Config, changes: Mapping[str, Any]) -> int:
    """`convert` with a MaxText checkpoint on one side (`migrate.checkpoints.maxtext_layouts`), and
    `compare` of two checkpoints of any kind, on MaxText's paths."""
    source, target = FLAGS["from"].value, FLAGS.to
    if command == "convert" and source == target:
        return usage_error("convert: --from=maxtext --to=maxtext is not a conversion")
    if FLAGS.dtype or FLAGS.verify_forward:
        return usage_error("--dtype and --verify_forward: not with a MaxText checkpoint")
    cfg = with_changes(cfg, changes)
    if command == "convert":  # the destination refused before JAX starts
        destination.check_destination(Path(paths[0]), Path(paths[1]), FLAGS.force)
    ensure_simulated_devices(cfg.num_devices)
    from migrate.checkpoints import maxtext_commands

    layout = FLAGS.layout or ("pipeline" if cfg.using_pipeline else "reference")
    return maxtext_commands.run_command(
        command, paths, cfg, (source, target), layout, FLAGS.force, FLAGS.verify
    )


COMMAND_HELP = (
    (
        "convert",
        "a checkpoint of one twin and layout into another (optimizer state and step "
        "included), leaf by leaf; --verify restores both and compares bit for bit, "
        "--verify_forward runs `parity --checks=forward` on the result",
    ),
    ("init", "a fresh checkpoint of either twin's own initialisation, in either layout"),
    (
        "port",
        "a Linen module's NNX port (docs/port.md): traced once on --inputs, written with its "
        "weight map and a pytest gate beside it, then gated: exit 0 the port passes, 1 it fails",
    ),
    (
        "compare",
        "two checkpoints of any kind (either twin, either layout, MaxText 0.2.3 or 0.2.5) leaf "
        "by leaf on MaxText's paths: exit 0 bit-identical, 1 they differ (each named)",
    ),
)
EXIT_STATUSES = (
    ("0", "the checkpoint was written"),
    (
        "1",
        "a verification (--verify, --verify_forward) failed, nothing was written; port: the "
        "written port fails its gate",
    ),
    (
        "2",
        "bad input: usage, config, checkpoint (missing, corrupt, edited meta, another "
        "model), destination, full disk; the destination untouched",
    ),
    ("4", "an internal error (--verbose: the traceback)"),
    ("128+N", "stopped by signal N (130 SIGINT, 143 SIGTERM); the staging directory removed"),
)


# The flags each command reads (every flag is some command's: tests/test_migrate_cli.py).
COMMAND_FLAGS = {
    "convert": (
        "config", "from", "to", "layout", "dtype", "force", "verify", "verify_forward",
        "memory_check", "verbose",
    ),
    "init": ("config", "framework", "layout", "force", "memory_check", "verbose"),
    "compare": ("config", "verbose"),
    "port": (
        "inputs", "out", "call_kwargs", "names", "fields_from", "method", "force", "verbose",
    ),
}  # fmt: skip


def command_usage(command: str) -> str:
    """The usage lines of `command` (each with its continuation lines) from `USAGE`."""
    entries: list[list[str]] = []
    for line in USAGE.splitlines():
        if line.startswith("    migrate "):
            entries.append([line])
        elif line.startswith("            ") and entries:
            entries[-1].append(line)
    return "\n".join(line for entry in entries if entry[0].split()[1] == command for line in entry)


def help_text(command: str | None = None) -> str:
    """`migrate --help`: usage, the commands, every flag with its default, exit statuses;
    `migrate COMMAND --help`: that command's usage, what it does and its flags."""
    title = __doc__.split("\n\n")[0]
    if command is None:
        return cli_help.help_text(
            title, USAGE, [("commands", COMMAND_HELP)], FLAGS, list(FLAGS), EXIT_STATUSES
        )
    does = [(name, text) for name, text in COMMAND_HELP if name == command]
    return cli_help.help_text(
        textwrap.fill(f"migrate {command}: {does[0][1]}", cli_help.WIDTH),
        command_usage(command),
        [],
        FLAGS,
        COMMAND_FLAGS[command],
        EXIT_STATUSES,
    )


def _parse_flags(argv: list[str]) -> list[str] | int:
    """Flags into `FLAGS`; a bad flag is a usage error (one line, exit 2). `--help` prints the
    help of the command given before it (`migrate convert --help`), else the whole page;
    `--version` the versions."""
    if cli_help.wants_help(argv) or "--helpfull" in argv[1:]:
        commands = [arg for arg in argv[1:] if arg in COMMANDS]
        print(help_text(commands[0] if commands else None))
        return EXIT_OK
    if cli_help.wants_version(argv):
        print(cli_help.version_text("migrate"))
        return EXIT_OK
    try:
        return FLAGS(argv)
    except flags.Error as e:
        return usage_error(str(e))


def return_freed_memory() -> None:
    """Have glibc return freed blocks of 1 MiB and more to the OS at once.

    By default glibc raises its mmap threshold each time a large block is freed, so the host
    buffers that Orbax and XLA free while restoring stay in the process and add to its peak
    (bench/checkpoint_memory.py measures both). A no-op where there is no glibc.
    """
    m_mmap_threshold = -3  # from glibc's malloc.h
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 2**20)


def _quiet_abandoned_reads(unraisable) -> None:
    """After a failed read or an interrupted save, Orbax's pending TensorStore work ends in its
    closed event loop or is dropped unfinished, and its event loop is collected while still
    running; the error was already reported, so drop that noise (only that)."""
    error, source = unraisable.exc_value, unraisable.object
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return
    if getattr(source, "__qualname__", "") == "BaseEventLoop.__del__":
        return
    code = getattr(source, "cr_code", None)
    if code is not None and "/orbax/" in code.co_filename.replace("\\", "/"):
        return
    sys.__unraisablehook__(unraisable)


def _main(argv: list[str]) -> int:
    parsed = _parse_flags(argv)
    return parsed if isinstance(parsed, int) else run(parsed)


def main() -> None:
    """Console-script entry point: every exception becomes its exit status
    (`migrate.errors`), SIGINT and SIGTERM remove the staging directory."""
    logging.set_verbosity(logging.WARNING)
    sys.unraisablehook = _quiet_abandoned_reads
    return_freed_memory()
    verbose = lambda: FLAGS["verbose"].value or "--verbose" in sys.argv
    if not verbose():
        cli_support.quiet_library_tracebacks()
    status = cli_support.guarded("migrate", lambda: _main(sys.argv), verbose)
    cli_support.exit_now(status, program="migrate")


if __name__ == "__main__":
    main()
