"""The twins' migration idioms, as data: every difference between `migrate/linen/X.py` and
`migrate/nnx/X.py` is one of these (`tests/test_twin_diff.py` diffs each pair and fails on any
other), and docs/migration-guide.md renders the table (`markdown_table`).

Both twins are compared as statements (`ast.unparse`), after the presentation normalisations
(`NORMALISATIONS`). An idiom explains a difference in one of three ways, each a regular
expression over a statement's text:

- `rewrites`: `(side, pattern, replacement)` applied before the diff, for a spelling that maps
  one to one (`nn.remat` -> `nnx.remat`); the rest of the statement must then be equal;
- `linen_lines` / `nnx_lines`: a statement only that twin has (matched whole);
- `scopes`: functions (`Class.method`, `function`) whose differing statements are all this
  idiom's, where the two twins' bodies differ throughout.

No JAX import: the table is read by the test and the docs.
"""

from __future__ import annotations

from dataclasses import dataclass

Rewrite = tuple[str, str, str]  # (side: "linen" | "nnx", pattern, replacement)


@dataclass(frozen=True)
class Idiom:
    """One migration idiom: its name, the two forms, why they differ, and how the twins' diff
    recognises it."""

    name: str
    linen: str
    nnx: str
    why: str
    rewrites: tuple[Rewrite, ...] = ()
    linen_lines: tuple[str, ...] = ()
    nnx_lines: tuple[str, ...] = ()
    scopes: tuple[str, ...] = ()
    constructor: bool = False  # Linen's fields + `setup` read as an `__init__` (see `IDIOMS`)


@dataclass(frozen=True)
class Normalisation:
    """What the diff leaves out or reorders before comparing, and why it is not migration."""

    name: str
    why: str


NORMALISATIONS = (
    Normalisation(
        "docstrings and comments",
        "each twin describes its own framework; the code is what is compared",
    ),
    Normalisation(
        "type annotations",
        "a Linen box tree and an `nnx.State` (a module and a `GraphDef`) are typed apart "
        "wherever the idioms below make their values differ",
    ),
    Normalisation(
        "layout",
        "one statement per line as `ast.unparse` prints it: the formatter wraps `nn.` and "
        "`nnx.` lines at different places",
    ),
    Normalisation(
        "import order",
        "module-level imports are compared sorted: the formatter sorts `import flax.linen as "
        "nn` and `from flax import nnx` apart",
    ),
)

IDIOMS = (
    Idiom(
        "framework import",
        "`import flax.linen as nn`",
        "`from flax import nnx`",
        "each twin imports its framework once, under its usual name",
        rewrites=(("linen", r"^import flax\.linen as nn$", "from flax import nnx"),),
    ),
    Idiom(
        "twin modules",
        "`from migrate.linen.layers import ...`",
        "`from migrate.nnx.layers import ...`",
        "each twin imports its own twin's modules",
        rewrites=(("linen", r"\bmigrate\.linen\b", "migrate.nnx"),),
    ),
    Idiom(
        "module base class",
        "`class X(nn.Module)`",
        "`class X(nnx.Module)`",
        "the same role: a module with weights and submodules",
        rewrites=(("linen", r"\bnn\.Module\b", "nnx.Module"),),
    ),
    Idiom(
        "constructor",
        "dataclass fields; submodules and parameters declared in `setup()`",
        "`__init__` taking the fields, storing each on `self`, then `setup`'s body",
        "a Linen module is a frozen dataclass whose `setup` runs lazily inside `init`/`apply`; "
        "an NNX module is a plain object built eagerly by its constructor",
        constructor=True,
    ),
    Idiom(
        "random keys",
        "keys drawn from the scope `init` was given",
        "`*, rngs: nnx.Rngs` in every constructor that creates weights, passed on as `rngs=rngs`",
        "NNX creates weights in the constructor, so the keys travel with it",
        rewrites=(("nnx", r", \*, rngs\):$", "):"), ("nnx", r", rngs=rngs\)", ")")),
    ),
    Idiom(
        "parameter declaration",
        "`self.param(name, nn.with_logical_partitioning(init, names), shape, dtype)`",
        "`nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names)`",
        "Linen boxes the value with its logical names (`LogicallyPartitioned`); NNX keeps "
        "them in the Variable's metadata; the path is the attribute name on both sides",
        rewrites=(
            (
                "nnx",
                r"^self\.(\w+) = nnx\.Param\(([\w.]+)\(rngs\.params\(\), (.+), "
                r"([\w.]+(?:\([\w.]*\))?)\), out_sharding=([\w.]+)\)$",
                r"self.\1 = self.param('\1', nn.with_logical_partitioning(\2, \5), \3, \4)",
            ),
        ),
    ),
    Idiom(
        "parameter value",
        "`self.kernel` (the array)",
        "`self.kernel[...]`",
        "an NNX Param is a Variable holding the array; `[...]` reads it",
        rewrites=(("nnx", r"(?<=[\w)\]])\[\.\.\.\]", ""),),
    ),
    Idiom(
        "weight type",
        "`nn.LogicallyPartitioned` (a box: `value`, `names`)",
        "`nnx.Variable` (`out_sharding` in its metadata)",
        "the leaf type a tree of weights is mapped over",
        rewrites=(("linen", r"\bnn\.LogicallyPartitioned\b", "nnx.Variable"),),
    ),
    Idiom(
        "activation constraint",
        "`nn.with_logical_constraint(x, names, rules=rules, mesh=mesh)`",
        "`sharding.constrain(x, names, mesh, rules) if rules else x`",
        "NNX has no logical constraint of its own: the port resolves the names with Linen's "
        "resolver and calls `jax.lax.with_sharding_constraint`, and skips where Linen's does "
        "(no rules); every call site is `constrain(x, names, mesh, rules)` on both sides",
        linen_lines=(r"return nn\.with_logical_constraint\(x, names, rules=rules, mesh=mesh\)",),
        nnx_lines=(r"return sharding\.constrain\(x, names, mesh, rules\) if rules else x",),
    ),
    Idiom(
        "dropout with a raw key",
        "`nn.Dropout(rate, broadcast_dims=...)`, called `(x, deterministic=False, rng=key)`",
        "`nnx.Dropout(rate, broadcast_dims=...)`, called `(x, deterministic=False, rngs=key)`",
        "given the same raw key, both draw the same mask; by stream they never would (Linen's "
        "`make_rng` folds in the module path, an `nnx.Rngs` stream its call count), so the "
        "twins key every mask themselves (`migrate.common.dropout`: per row, layer and site)",
        rewrites=(
            ("linen", r"\bnn\.Dropout\(", "nnx.Dropout("),
            ("linen", r"\brng=key\)", "rngs=key)"),
        ),
    ),
    Idiom(
        "remat",
        "`nn.remat(apply_layer, policy=..., prevent_cse=False)`",
        "`nnx.remat(apply_layer, policy=..., prevent_cse=False)`",
        "both lift `jax.checkpoint` over `apply_layer(layer, x, positions)`, a function whose "
        "first argument is the module (`remat_layer`); the same policy saves the same tensors",
        rewrites=(("linen", r"\bnn\.remat\(", "nnx.remat("),),
    ),
    Idiom(
        "stacked layers",
        "one layer declared; `nn.scan(..., variable_axes={'params': 0}, metadata_params=...)` "
        "creates the stack at `init` and runs it (its length and axis name at the call)",
        "`stack_modules` (`nnx.split_rngs` + `nnx.vmap` + `nnx.transform_metadata`) creates the "
        "stack; `jax.lax.scan` over `nnx.merge(graphdef, layer_state)` runs it",
        "a Linen transform creates the stack and applies it in one; NNX creates it in the "
        "constructor and applies it functionally, as the pipeline loop does",
        rewrites=(
            (
                "linen",
                r"\bscan_layers\((self\.layers, x, positions), length, axes\.\w+",
                r"scan_layers(\1",
            ),
            (
                "linen",
                r"^def scan_layers\(layer, x, positions, length, axis_name, ",
                "def scan_layers(layer, x, positions, ",
            ),
            (
                "nnx",
                r"^self\.layers = stack_modules\(lambda r: (.+), rngs=r\), "
                r"[\w.]+, axes\.\w+, rngs\)$",
                r"self.layers = \1)",
            ),
            ("nnx", r"^(from migrate\.nnx\.pipeline import .+), stack_modules$", r"\1"),
        ),
        linen_lines=(
            r"length = cfg\.\w+",
            r"def body\(module, carry, pos, layer_id\):",
            r"y, aux = call\(module, carry\[0\], dropout\.at_layer\(pos, layer_id\)\)",
            r"scanned = nn\.scan\(body, .+\)",
            r"\(x, aux\), outputs = scanned\(layer, \(x, jnp\.zeros\(\(\)\)\), positions, "
            r"layer_ids\)",
        ),
        nnx_lines=(
            r"graphdef, state = nnx\.split\(layer\)",
            r"def body\(carry, xs\):",
            r"layer_state, layer_id = xs",
            r"pos = dropout\.at_layer\(positions, layer_id\)",
            r"y, aux = call\(nnx\.merge\(graphdef, layer_state\), carry\[0\], pos\)",
            r"length = jax\.tree\.leaves\(state\)\[0\]\.shape\[0\]",
            r"\(x, aux\), outputs = jax\.lax\.scan\(body, \(x, jnp\.zeros\(\(\)\)\), "
            r"\(state, layer_ids\)\)",
        ),
        scopes=("stack_modules",),
    ),
    Idiom(
        "stacked stages",
        "`nn.vmap(StageLayers, variable_axes={'params': 0}, spmd_axis_name='stage', "
        "metadata_params=...)`: a class, instantiated in `setup`",
        "`stack_modules(lambda r: StageLayers(..., rngs=r), S, axes.STAGE, rngs)`: the module",
        "as stacked layers, once per stage and once per circular repeat",
        linen_lines=(r"self\.layers = stacked_stages\(cfg\)\(cfg, self\.mesh\)",),
        nnx_lines=(r"self\.layers = stacked_stages\(cfg, self\.mesh, rngs\)",),
        scopes=("stacked_stages",),
    ),
    Idiom(
        "weights created by a call",
        "`if self.is_initializing(): self.layers(...)`: `init` traces a call to create them",
        "(none: the constructor created them)",
        "Linen creates a lifted transform's weights the first time it runs",
        linen_lines=(
            r"if self\.is_initializing\(\):",
            r"first = jax\.tree\.map\(lambda p: p\[:cfg\.microbatch_size\], positions\)",
            r"self\.layers\(inputs\[:cfg\.microbatch_size\], first\)",
            r"return \(inputs, jnp\.zeros\(\(\)\)\)",
        ),
    ),
    Idiom(
        "functional application",
        "`stage.apply({'params': w}, ...)`, `stage` an unbound copy (`parent=None`), `w` from "
        "`self.variables['params']`, unboxed",
        "`nnx.merge(stage, w)(...)`, `stage, w = nnx.split(submodule)`",
        "the pipeline loop and the train step call a module on weights they pass in: the "
        "stage weights are sliced per repeat and vmapped over stages",
        rewrites=(("nnx", r"\bnnx\.merge\((\w+), (\w+)\)\(", r"\1.apply({'params': \2}, "),),
        linen_lines=(
            r"stage = StageLayers\(cfg, self\.mesh, parent=None\)",
            r"boxed_weights = self\.variables\['params'\]\['layers'\]",
            r"weights = nn\.meta\.unbox\(boxed_weights\)",
        ),
        nnx_lines=(r"stage, weights = nnx\.split\(self\.layers\)",),
    ),
    Idiom(
        "logical names of weights",
        "`nn.get_partition_spec(boxes)` (or `box.names`), mapped beside the arrays",
        "`variable.get_metadata()['out_sharding']`, mapped over the Variables "
        "(`variable.replace(new_value)`)",
        "the names travel in the boxes' tree (Linen) or in each Variable (NNX)",
        rewrites=(
            (
                "linen",
                r"^weights = self\.all_gather_over_fsdp\(boxed_weights, weights\)$",
                "weights = self.all_gather_over_fsdp(weights)",
            ),
        ),
        linen_lines=(
            r"gathered = jax\.tree\.map\(lambda names: .+, nn\.get_partition_spec\(.+\), "
            r"is_leaf=lambda x: isinstance\(x, jax\.sharding\.PartitionSpec\)\)",
            r"stage_weights = jax\.tree\.map\(jax\.lax\.with_sharding_constraint, stage_weights, "
            r"gathered\)",
        ),
        nnx_lines=(
            r"def gathered\(variable\):",
            r"names = tuple\(variable\.get_metadata\(\)\['out_sharding'\]\)\[stacked:\]",
            r"spec = sharding\.gathered_over_fsdp\(names, self\.mesh, cfg\)",
            r"return variable\.replace\(jax\.lax\.with_sharding_constraint\(variable, spec\)\)",
            r"stage_weights = jax\.tree\.map\(gathered, stage_weights, "
            r"is_leaf=lambda x: isinstance\(x, nnx\.Variable\)\)",
        ),
        scopes=("param_shardings", "Pipeline.all_gather_over_fsdp", "Pipeline.all_gather_window"),
    ),
    Idiom(
        "initial weights",
        "`init_model` returns the boxed variables of `Decoder(...).init(key, tokens)`",
        "`init_model` returns the `Decoder`, built under `nnx.eval_shape` and then jitted",
        "Linen's `init` traces a call on example tokens and returns the variables; an NNX "
        "module holds its weights, so the port returns the module, built without eager "
        "sharding and each array placed by its full `out_sharding`",
        scopes=("init_model",),
    ),
)


def markdown_table() -> str:
    """The idioms as the Markdown table docs/migration-guide.md shows."""
    rows = ["| idiom | Linen | NNX | why |", "| --- | --- | --- | --- |"]
    rows += [f"| {i.name} | {i.linen} | {i.nnx} | {i.why} |" for i in IDIOMS]
    return "\n".join(rows) + "\n"
