"""Every module call's output during a MaxText decoder's trace, by module path: the capture
the MaxText side's `layers` drill-down runs (`parity.maxtext.decoder_factory`), in the
release's environment. Imports Flax and JAX only when recording."""

from __future__ import annotations

from typing import Any


class CallRecorder:
    """Every module call's output during a trace, by module path, recorded when the program
    runs (`jax.debug.callback`: inside MaxText's pipeline loops and its vmap over stages, one
    call per stage per iteration, in that order). The path is Linen's scope path for a Linen
    module (`nn.intercept_methods`; 0.2.3's decoder and pipeline) and, for an NNX module, its
    parent's path plus the attribute that holds it (every `maxtext` NNX class's `__call__`
    wrapped while recording): the parameter paths both releases share. A module the pipeline
    rebuilds from its graph (a copy) is named by the parent's attribute of its type."""

    def __init__(self, framework: str) -> None:
        self.framework = framework
        self.calls: dict[str, list[list[Any]]] = {}
        # (path, the module, its Linen scope root's path) of the calls in progress
        self._stack: list[tuple[str, Any, str]] = []
        self._undo: list[Any] = []

    def __enter__(self) -> CallRecorder:
        import flax.linen as nn
        from flax import nnx

        for cls in _subclasses(nnx.Module):
            if cls.__module__.startswith("maxtext.") and "__call__" in cls.__dict__:
                original = cls.__dict__["__call__"]
                cls.__call__ = self._wrapped(original)
                self._undo.append((cls, original))
        if self.framework == "linen":
            self._intercept = nn.intercept_methods(self._linen_call)
            self._intercept.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for cls, original in reversed(self._undo):
            cls.__call__ = original
        if self.framework == "linen":
            self._intercept.__exit__(*exc)

    def _record(self, path: str, out: Any) -> None:
        import jax
        import numpy as np

        leaves = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
        if not leaves or not path or _in_scan_broadcast_pass():
            return
        self.calls.setdefault(path, [])
        sink = lambda *xs: self.calls[path].append([np.asarray(x) for x in xs])
        jax.debug.callback(sink, *leaves)

    def _linen_call(self, next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        bridged = any(c.__name__ == "ToLinen" for c in type(module).__mro__)
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        # A module applied in a scope of its own (the pipeline's stages: `layers.apply`)
        # roots its submodules' scope paths: they continue that module's path.
        root = next((r for _, m, r in reversed(self._stack) if not _is_nnx(m)), "")
        path = "/".join([root, *map(str, module.path)]).strip("/")
        if not module.path and self._stack:
            root = f"{self._stack[-1][0]}/{module.name or type(module).__name__}".lstrip("/")
            path = root
        self._stack.append((path, module, root))
        try:
            out = next_fun(*args, **kwargs)
        finally:
            self._stack.pop()
        if not bridged:  # a bridged NNX module records itself, under this path
            self._record(path, out)
        return out

    def _nnx_path(self, module: Any) -> str:
        from flax import nnx

        if not self._stack:
            return ""
        parent_path, parent, _ = self._stack[-1]
        if not isinstance(parent, nnx.Module):
            return parent_path  # the NNX module inside a Linen bridge: the bridge's path
        for path, above, _ in reversed(self._stack):  # a module passed down (a shared embedding)
            if isinstance(above, nnx.Module):
                for name, child in _children(above):
                    if child is module:
                        return f"{path}/{name}".lstrip("/")
        by_type = []
        for name, child in _children(parent):
            if type(child) is type(module):
                by_type.append(name)
        if len(by_type) == 1:
            return f"{parent_path}/{by_type[0]}".lstrip("/")
        return f"{parent_path}/{type(module).__name__}".lstrip("/")

    def _wrapped(self, original: Any) -> Any:
        recorder = self

        def call(module: Any, *args: Any, **kwargs: Any) -> Any:
            path = recorder._nnx_path(module)
            recorder._stack.append((path, module, ""))
            try:
                out = original(module, *args, **kwargs)
            finally:
                recorder._stack.pop()
            recorder._record(path, out)
            return out

        return call


def _in_scan_broadcast_pass() -> bool:
    """Whether Linen's `nn.scan` is tracing its body to find what it broadcasts (flax's
    `axes_scan`, `body_fn(..., init_mode=True)`): a callback there would be a dependency of
    the broadcast values on the body, which flax refuses; the body's real trace records."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        in_flax_scan = code.co_name == "body_fn" and code.co_filename.endswith("axes_scan.py")
        if in_flax_scan and frame.f_locals.get("init_mode"):
            return True
        frame = frame.f_back
    return False


def _is_nnx(module: Any) -> bool:
    from flax import nnx

    return isinstance(module, nnx.Module)


def _subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.append(sub)
                todo.append(sub)
    return out


def _children(module: Any) -> list[tuple[str, Any]]:
    """An NNX module's direct submodules by attribute (a list's or dict's items as `name/key`)."""
    from flax import nnx

    out = []
    for name, value in vars(module).items():
        if isinstance(value, nnx.Module):
            out.append((name, value))
        elif isinstance(value, list | tuple | dict):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            out += [(f"{name}/{k}", v) for k, v in items if isinstance(v, nnx.Module)]
    return out
