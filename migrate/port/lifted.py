"""How the planner ports a call of a function of the user's that applies a Linen lifted
transform (`scan_layers(self.layers, ...)`): the function ported beside the class
(`functions.py`), and the submodule it stacks built stacked in `__init__` (`stacked_modules`),
with the size and axis name the call gives, verified against the trace."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import libcst as cst

from migrate.port import functions as fn
from migrate.port import rewrite as rw
from migrate.port import source as src
from migrate.port.ported import code_of
from migrate.port.trace import Trace


class LiftedCalls:
    """The lifted-call half of `planner.Planner`, on the planner's state."""

    source: src.ClassSource
    trace: Trace | None
    scope: Mapping[str, Any]
    ported: Collection[type]
    functions: dict[Any, fn.FunctionPort]
    stacked: dict[str, tuple[str, str]]
    mark: Callable[..., None]  # a call left as written, marked (`Planner.mark`)
    evaluate: Callable[[str], Any]

    def lifted_calls(self) -> None:
        """Each call of a function of the user's that applies a Linen lifted transform: the
        function ported beside the class (`functions.py`), the submodule whose variables it
        stacks built stacked (`stacked_modules`); or the call marked, the class's Linen code."""
        for call in self.source.self_calls:
            if call.function is None:
                continue
            ported = fn.port(call.function)
            missing = [c.__name__ for c in ported.classes if c not in self.ported]
            why = ported.refusal or (
                f"the class it transforms, {missing[0]}, is not ported" if missing else None
            )
            why = why or self.stack(call, ported)
            if why is not None:
                self.mark(call, call.method, f"{why}: port it by hand", linen_code=True)
                continue
            for needed in ported.needed():
                self.functions[needed.function] = needed

    def stack(self, call: src.SelfCall, ported: fn.FunctionPort) -> str | None:
        """Where the function stacks the variables of the module handed to it, the size and
        axis name the submodule handed is built with: the call's own expressions for them
        where `__init__` can evaluate those to the traced values, else the traced values.
        Why it cannot be (None: it can, or nothing is stacked)."""
        stacking = ported.stacking
        if stacking is None:
            return None
        function = call.function
        handed = (
            fn.bound_argument(function, call.node, stacking.parameter)
            if stacking.parameter is not None
            else None
        )
        attribute = src.self_attribute(handed) if handed is not None else None
        if attribute is None or self.source.style != "setup":
            return "the module it stacks is not a submodule made in setup (self.NAME)"
        axes = self.trace.stacked_axes(attribute) if self.trace is not None else []
        size_text = self.call_text(call, function, stacking.size)
        name_text = self.call_text(call, function, stacking.axis_name)
        given = (
            self.evaluate(size_text) if size_text else None,
            self.evaluate(name_text) if name_text else None,
        )
        if size_text is not None and (not axes or _stacked_at(axes, given)):
            # The call's own expressions, verified against the trace where it was traced (at
            # any leading axis: the class may itself sit under another transform's axes).
            if name_text is None and stacking.axis_name is not None:
                at = next((n for s, n in axes if s == given[0]), None)  # as traced
                name_text = repr(at) if at is not None else None
            if name_text is None and stacking.axis_name is not None:
                return "its stacked axis name cannot be evaluated in __init__"
            self.stacked[attribute] = (size_text, name_text or "None")
            return None
        if not axes:
            return "its stacked size cannot be evaluated in __init__ and was never traced"
        if size_text is not None or (stacking.axis_name is not None and name_text is None):
            return "its stacked size or axis name does not match the trace"
        self.stacked[attribute] = (repr(axes[0][0]), repr(axes[0][1]))  # the leading axis
        return None

    def call_text(
        self, call: src.SelfCall, function: Any, expression: cst.BaseExpression | None
    ) -> str | None:
        """The expression the function's `expression` (a parameter of it) takes at `call`,
        as `__init__` evaluates it: the locals of the method making the call substituted;
        None where it is no parameter, not passed, or reads values of the call."""
        if not isinstance(expression, cst.Name):
            return None
        given = fn.bound_argument(function, call.node, expression.value)
        if given is None or call.enclosing is None:
            return None
        values = rw.static_values(rw.locals_of(call.enclosing), self.scope)
        substituted = rw.substitute(given, values)
        return code_of(substituted) if src.is_static(substituted, self.scope) else None


def _stacked_at(axes: list[tuple[int, str | None]], given: tuple[Any, Any]) -> bool:
    """Whether the traced leading axes hold one of the size and name `given` (a name None:
    any)."""
    size, name = given
    return any(s == size and (name is None or n == name) for s, n in axes)
