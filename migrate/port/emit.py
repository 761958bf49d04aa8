"""One NNX class written from one Linen class (`planner.py` plans it): `__init__(self,
<fields>, *, rngs)` (a compact module's constructors moved there, a `setup` body inlined
there), then every method rewritten around the plan (`rewrite.py`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import libcst as cst

from migrate.port import rewrite as rw
from migrate.port import source as src
from migrate.port.planner import Planner
from migrate.port.ported import Emitted, code_of
from migrate.port.trace import Trace


def _init(
    source: src.ClassSource, lines: list[str], setup: cst.FunctionDef | None
) -> cst.FunctionDef:
    """`__init__(self, <fields>, *, rngs)`: each field kept as an attribute, then `lines` (a
    compact module's constructors) or the `setup` body as rewritten."""
    params = [
        code_of(f.target) + ": " + code_of(f.annotation.annotation)
        + (f" = {code_of(f.value)}" if f.value is not None else "")
        for f in source.fields
    ]  # fmt: skip
    names = [code_of(f.target) for f in source.fields]
    signature = ", ".join(["self", *params, "*", "rngs: nnx.Rngs"])
    body = [f"self.{n} = {n}" for n in names] + lines
    text = f"def __init__({signature}):\n" + "".join(f"    {line}\n" for line in body or ["pass"])
    init = cst.parse_statement(text)
    if setup is None:
        return init
    assigned = list(init.body.body) if body else []  # `pass` where there are no fields
    inlined = list(setup.body.body)
    if inlined and _is_docstring(inlined[0]):  # setup's docstring stays first
        return init.with_changes(
            body=init.body.with_changes(body=[inlined[0], *assigned, *inlined[1:]])
        )
    return init.with_changes(body=init.body.with_changes(body=[*assigned, *inlined]))


def _is_docstring(statement: cst.BaseStatement) -> bool:
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and isinstance(statement.body[0], cst.Expr)
        and isinstance(statement.body[0].value, cst.SimpleString | cst.ConcatenatedString)
    )


def emit(
    source: src.ClassSource,
    trace: Trace | None,
    names: str = "linen",
    ported: Collection[type] = (),
    refused: Mapping[type, str] | None = None,
) -> Emitted:
    """The NNX class for `source`, planned against `trace` (None: a class the trace never
    built, ported from its source alone); `ported`: the user's classes ported beside it,
    `refused`: those that could not be, and why (their sites are bridged)."""
    planner = Planner(source, trace, names, ported, refused or {})
    planner.lifted_calls()
    if source.style == "compact":
        if trace is None:
            raise src.PortError(f"{source.cls.__name__}: compact and never traced")
        planner.compact_sites()
    elif source.style == "setup":
        planner.setup_sites()
    planner.self_calls()
    taken = [p.attribute for p in planner.placed]
    clash = sorted({a for a in taken if taken.count(a) > 1} | (set(taken) & _own(source)))
    if clash:
        raise src.PortError(f"attribute names collide in the port: {', '.join(clash)}")
    ported_names = {cls: cls.__name__ for cls in ported}
    held = frozenset(n for n, c in source.class_locals.items() if c in ported_names)
    helpers: set[str] = set()

    def edits(**changes: Any) -> rw.Edits:
        common = dict(
            calls=planner.self_edits,
            ported=ported_names,
            class_locals=held,
            variable_reads=frozenset(planner.variable_reads),
            branches=planner.branches,
            call_renamed=planner.call_renamed,
        )
        return rw.Edits(**{**common, **changes}, helpers=helpers)

    setup = None
    if source.setup is not None:
        setup = rw.rewrite(
            source,
            source.setup,
            edits(dropped=frozenset(planner.dropped), listed=frozenset(planner.listed)),
        )
    init = _init(source, planner.init_lines, setup)
    body: list[cst.CSTNode] = []
    placed_init = False
    for statement in source.class_def.body.body:
        if isinstance(statement, cst.SimpleStatementLine) and any(
            statement.body[0] is f for f in source.fields
        ):
            continue
        if isinstance(statement, cst.FunctionDef) and statement.name.value == "setup":
            continue
        if isinstance(statement, cst.FunctionDef):
            if not placed_init:  # `__init__` before the first method
                body.append(init.with_changes(leading_lines=_blank(body)))
                placed_init = True
            reads = frozenset(planner.param_reads)
            if statement is source.call:
                dropped = frozenset(planner.dropped)
                changes = edits(sites=planner.edits, param_reads=reads, dropped=dropped)
            else:
                changes = edits(param_reads=reads)
            method = rw.rewrite(source, statement, changes)
            if not method.leading_lines:
                method = method.with_changes(leading_lines=_blank(body))
            body.append(method)
        else:
            body.append(statement)
    if not placed_init:
        body.append(init.with_changes(leading_lines=_blank(body)))
    nnx_base = cst.Arg(cst.parse_expression("nnx.Module"))
    class_def = source.class_def.with_changes(
        bases=[nnx_base], body=source.class_def.body.with_changes(body=body), decorators=[]
    )
    code = cst.Module(body=[class_def]).code
    needs = frozenset(planner.needs)
    helpers = frozenset(helpers | planner.helpers)
    variables = dict(planner.variable_types)
    functions = tuple(planner.functions.values())
    return Emitted(
        code, tuple(planner.placed), tuple(planner.stubs), needs, helpers, variables, functions
    )


def _blank(before: list[cst.CSTNode]) -> list[cst.EmptyLine]:
    return [cst.EmptyLine(indent=False)] if before else []


def _own(source: src.ClassSource) -> set[str]:
    methods = {s.name.value for s in source.class_def.body.body if isinstance(s, cst.FunctionDef)}
    return methods | {code_of(f.target) for f in source.fields}
