"""The command line's example inputs and call arguments, parsed and checked before JAX:
`float32[4,8];int32[4]` (one array per positional argument) and `train=False,rate=0.5`
(literal keyword arguments; `;` separates the calls). No JAX here."""

from __future__ import annotations

import ast
import dataclasses
import re

import numpy as np

from migrate.errors import BadInput

_ARRAY = re.compile(r"^\s*([a-z][a-z0-9]*)\s*\[\s*([0-9,\s]*)\]\s*$")
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "int8", "uint8", "bool")


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """One example input: its dtype's name and shape."""

    dtype: str
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"

    @property
    def is_float(self) -> bool:
        return self.dtype.startswith(("float", "bfloat"))


def parse_inputs(text: str) -> tuple[ArraySpec, ...]:
    """`float32[4,8];int32[4]` -> one `ArraySpec` per positional argument; BadInput otherwise."""
    if not text or not text.strip():
        raise BadInput("--inputs is required: one DTYPE[SHAPE] per argument, e.g. float32[4,8]")
    specs = []
    for part in text.split(";"):
        found = _ARRAY.match(part)
        if found is None:
            raise BadInput(f"--inputs: {part.strip()!r} is not DTYPE[SHAPE] (e.g. float32[4,8])")
        dtype, dims = found.group(1), [d.strip() for d in found.group(2).split(",") if d.strip()]
        if dtype not in DTYPES:
            raise BadInput(f"--inputs: unknown dtype {dtype!r}; one of {', '.join(DTYPES)}")
        shape = tuple(int(d) for d in dims)
        if any(d == 0 for d in shape) or np.prod(shape, dtype=np.int64) > 2**26:
            raise BadInput(f"--inputs: {part.strip()} has an empty or too large shape")
        specs.append(ArraySpec(dtype, shape))
    return tuple(specs)


def parse_call_kwargs(text: str | None) -> tuple[dict[str, object], ...]:
    """`train=True,rate=0.5;train=False` -> one dict of literal keyword arguments per call
    (one empty call when `text` is empty); BadInput for anything but `name=literal`."""
    if not text or not text.strip():
        return ({},)
    calls = []
    for call in text.split(";"):
        kwargs: dict[str, object] = {}
        for item in filter(None, (i.strip() for i in call.split(","))):
            name, sep, value = item.partition("=")
            if not sep or not name.strip().isidentifier():
                raise BadInput(f"--call_kwargs: {item!r} is not NAME=VALUE")
            try:
                kwargs[name.strip()] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                raise BadInput(
                    f"--call_kwargs: {item!r}: the value is not a Python literal"
                ) from None
        calls.append(kwargs)
    return tuple(calls)


def parse_target(text: str) -> tuple[str, str, dict[str, object]]:
    """`MODULE:CLASS` or `MODULE:CLASS(field=literal, ...)` -> (module, class, fields)."""
    module, sep, rest = text.partition(":")
    if not sep or not module or not rest:
        raise BadInput(f"expected MODULE:CLASS (e.g. mypkg.layers:MLP), got {text!r}")
    try:
        node = ast.parse(rest.strip(), mode="eval").body
    except SyntaxError:
        raise BadInput(f"{rest!r} is not CLASS or CLASS(field=literal, ...)") from None
    if isinstance(node, ast.Name):
        return module, node.id, {}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
        try:
            fields = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        except ValueError:
            raise BadInput(f"{rest!r}: each field's value must be a Python literal") from None
        if len(fields) == len(node.keywords):
            return module, node.func.id, fields
    raise BadInput(f"{rest!r} is not CLASS or CLASS(field=literal, ...)")


def parse_fields_from(text: str) -> tuple[str, str]:
    """`MODULE:FUNCTION` -> (module, function); BadInput for another form."""
    module, sep, function = text.partition(":")
    if not sep or not module or not function.isidentifier():
        raise BadInput(f"--fields_from: expected MODULE:FUNCTION, got {text!r}")
    return module, function


def check_fields_from(text: str, target: str) -> None:
    """`--fields_from` well formed, and not beside fields given in the target
    (`CLASS(field=...)`): BadInput otherwise."""
    parse_fields_from(text)
    if parse_target(target)[2]:
        raise BadInput("--fields_from and fields in the target (CLASS(...)): give one of them")
