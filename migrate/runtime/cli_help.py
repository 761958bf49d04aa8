"""`--help` and `--version` for both commands. `--help`: the usage, what each check or
command does, every flag of the command with its default, and the exit statuses. absl's own
`--help` lists only the flags of the main module, which for a console script is the script's
wrapper (so `parity --help` printed nothing but "Try --helpfull"); this reads the command's own
`FlagValues` instead. `--version`: the package's, JAX's, Flax's and Python's versions, read
from the installed distributions. No JAX here."""

from __future__ import annotations

import platform
import textwrap
from collections.abc import Iterable, Sequence
from importlib import metadata

from absl import flags

HELP_FLAGS = ("-h", "--help", "-help", "--helpshort")
KINDS = {"string": "TEXT", "int": "INT", "float": "FLOAT", "comma separated list of strings": "A,B"}
WIDTH = 100


def wants_help(argv: Sequence[str]) -> bool:
    return any(arg in HELP_FLAGS for arg in argv[1:])


def _default(flag: flags.Flag) -> str:
    if flag.default is None:
        return "none"
    if isinstance(flag.default, bool):
        return "true" if flag.default else "false"
    if isinstance(flag.default, list):
        return ",".join(map(str, flag.default)) or "''"
    return str(flag.default) if flag.default != "" else "''"


def _flag_line(flag: flags.Flag) -> list[str]:
    kind = ""
    if flag.boolean:
        head = f"--[no]{flag.name}"
    else:
        values = getattr(flag.parser, "enum_values", None)
        kind = "|".join(values) if values else KINDS.get(flag.flag_type(), flag.flag_type())
        head = f"--{flag.name}=<{kind}>"
    text = flag.help.removeprefix(f"<{kind}>: ") if not flag.boolean else flag.help
    # A help text that explains its own default (`--checks`) keeps it.
    body = text if "(default:" in flag.help else f"{text} (default: {_default(flag)})"
    return [
        f"  {head}",
        *textwrap.wrap(
            body, WIDTH, break_on_hyphens=False, initial_indent=" " * 6, subsequent_indent=" " * 6
        ),
    ]


def _described(title: str, items: Iterable[tuple[str, str]]) -> list[str]:
    items = list(items)
    width = max(len(name) for name, _ in items) + 2
    lines = [f"{title}:"]
    for name, text in items:
        wrapped = textwrap.wrap(text, WIDTH - width - 2, break_on_hyphens=False)
        lines.append(f"  {name.ljust(width)}{wrapped[0]}")
        lines.extend(f"  {' ' * width}{rest}" for rest in wrapped[1:])
    return lines


def help_text(
    title: str,
    usage: str,
    sections: Sequence[tuple[str, Iterable[tuple[str, str]]]],
    flag_values: flags.FlagValues,
    flag_names: Iterable[str],
    exits: Iterable[tuple[str, str]],
) -> str:
    """The whole `--help` page: `title`, `usage` (as written), each described section (checks,
    commands), every flag in `flag_names` with its default, and the exit statuses."""
    lines = [title, "", usage.rstrip(), ""]
    for name, items in sections:
        lines += [*_described(name, items), ""]
    lines.append("flags:")
    for name in sorted(set(flag_names)):
        lines += _flag_line(flag_values[name])
    lines += ["", *_described("exit status", exits)]
    return "\n".join(lines)


VERSION_FLAGS = ("--version",)
PACKAGE = "linen-nnx-parity"
VERSIONED = ("jax", "jaxlib", "flax")  # what a run's numbers depend on


def wants_version(argv: Sequence[str]) -> bool:
    return any(arg in VERSION_FLAGS for arg in argv[1:])


def versions() -> dict[str, str | None]:
    """Python's, this package's and each of `VERSIONED`'s installed version (None: not
    installed), read from the installed distributions: nothing is imported."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in (PACKAGE, *VERSIONED):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def version_text(program: str) -> str:
    """`PROGRAM --version`: the package's version, then JAX's, Flax's and Python's."""
    found = versions()
    libraries = ", ".join(f"{name} {found[name] or 'not installed'}" for name in VERSIONED)
    return f"{program} ({PACKAGE}) {found[PACKAGE]}; {libraries}; Python {found['python']}"
