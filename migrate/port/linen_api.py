"""Linen-only code the planner writes in its NNX form rather than marking it: `if
self.is_initializing():` (NNX has no init pass: the other branch kept), `self.variables[...]`
with a collection and names (`nnx.state`), and a dropout given its key at every call (no key
stream of its own)."""

from __future__ import annotations

import libcst as cst

from migrate.port import rewrite as rw
from migrate.port import source as src
from migrate.port.ported import Placed

# Linen collections NNX has a Variable type for; another one gets a subclass in the port file.
VARIABLE_TYPES = {"batch_stats": "nnx.BatchStat", "cache": "nnx.Cache", "params": "nnx.Param"}


class LinenApi:
    """The Linen-API half of `planner.Planner`, on the planner's state."""

    source: src.ClassSource
    placed: list[Placed]
    branches: dict[int, str]
    self_edits: dict[int, rw.SelfEdit]

    def linen_api(self) -> set[int]:
        """The Linen-only code the port writes in NNX, by the ids of its calls and attributes:
        `if self.is_initializing():` (NNX has no init pass: the other branch kept) and
        `self.variables["params"]["layers"]` (`nnx.state(self.layers, nnx.Param)`)."""
        tests, chains = _linen_api_uses(self.source.class_def)
        attributes = {p.linen: p.attribute for p in self.placed}
        claimed: set[int] = set()
        for call in self.source.self_calls:
            if call.method == "is_initializing" and id(call.node) in tests:
                if_node, kept = tests[id(call.node)]
                if not call.node.args:
                    self.branches[id(if_node)] = kept
                    claimed.add(id(call.node))
            elif call.method == "variables" and id(call.node) in chains:
                outer, keys = chains[id(call.node)]
                kind = VARIABLE_TYPES.get(keys[0]) if keys else None
                if kind is None:
                    continue
                path = [attributes.get(keys[1], keys[1]) if i == 0 else k
                        for i, k in enumerate(keys[1:])]  # fmt: skip
                held = ".".join(["self", *path])
                state = cst.parse_expression(f"nnx.state({held}, {kind})")
                self.self_edits[id(outer)] = rw.SelfEdit(state)
                claimed.add(id(call.node))
        return claimed

    def keyed_at_every_call(self, site: src.Site) -> bool:
        """Whether every call of the dropout `site` builds passes its key (`rng=`): its NNX
        form then holds no key stream of its own (`rngs=` at each call)."""
        if site.assigned is None:
            return site.called is not None and _passes_rng(site.called)
        reads, keyed = _self_reads(self.source.class_def, site.assigned)
        return reads > 0 and reads == keyed


def _linen_api_uses(
    class_def: cst.ClassDef,
) -> tuple[dict[int, tuple[cst.If, str]], dict[int, tuple[cst.Subscript, list[str]]]]:
    """In a class's methods: each `if` whose test is a call (or `not` a call), by the call's
    id, with the branch kept where the call is true; and each subscript chain on an attribute
    with string keys (`self.variables["params"]["layers"]`), by the attribute's id, as its
    outermost subscript and the keys."""
    tests: dict[int, tuple[cst.If, str]] = {}
    chains: dict[int, tuple[cst.Subscript, list[str]]] = {}

    class Uses(cst.CSTVisitor):
        def visit_If(self, node: cst.If) -> None:
            test = node.test
            if isinstance(test, cst.Call):
                tests[id(test)] = (node, "orelse")
            elif (
                isinstance(test, cst.UnaryOperation)
                and isinstance(test.operator, cst.Not)
                and isinstance(test.expression, cst.Call)
            ):
                tests[id(test.expression)] = (node, "body")

        def visit_Subscript(self, node: cst.Subscript) -> None:
            keys: list[str] = []
            base: cst.BaseExpression = node
            while isinstance(base, cst.Subscript):
                (element,) = base.slice if len(base.slice) == 1 else (None,)
                index = element.slice if element is not None else None
                key = index.value if isinstance(index, cst.Index) else None
                if not isinstance(key, cst.SimpleString):
                    return
                keys.insert(0, key.evaluated_value)
                base = base.value
            if isinstance(base, cst.Attribute) and len(keys) > len(
                chains.get(id(base), ((), []))[1]
            ):
                chains[id(base)] = (node, keys)

    class_def.visit(Uses())
    return tests, chains


def _passes_rng(call: cst.Call) -> bool:
    return any(a.keyword is not None and a.keyword.value == "rng" for a in call.args)


def _self_reads(class_def: cst.ClassDef, attribute: str) -> tuple[int, int]:
    """How often the class's methods read `self.ATTRIBUTE`, and how many of those are calls
    passing `rng=`."""
    counts = [0, 0]

    class Reads(cst.CSTVisitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> bool:
            return False  # `self.dropout = nn.Dropout(...)` builds it: no read

        def visit_Attribute(self, node: cst.Attribute) -> None:
            if src.self_attribute(node) == attribute:
                counts[0] += 1

        def visit_Call(self, node: cst.Call) -> None:
            if src.self_attribute(node.func) == attribute and _passes_rng(node):
                counts[1] += 1

    class_def.visit(Reads())
    return counts[0], counts[1]
