"""A MaxText gate config, read and validated before JAX: a YAML whose `maxtext:` mapping holds
MaxText's own keys (as its users type them on `train.py`'s command line), `key=value`
overrides on top, the environments of the two releases, and the synthetic batch both sides run
on (numpy). No JAX, no MaxText.

The keys the project knows (sizes, counts, parallelism, dtypes) are held to the twins' bounds
(`migrate.config.bounds`) here, before any worker starts: both releases accept nonsense such
as `base_num_decoder_layers=-4` and would gate it. Other keys are left to the releases.

    # configs/maxtext/pp4.yml
    maxtext:
      decoder_block: llama2
      ici_pipeline_parallelism: 4
      ...

A family whose releases compute the same math in another order may declare the tier its numeric
checks are held to, beside the located cause (`gate:`; bit-exact when absent):

    gate:
      tier: reordering          # a name of `parity.analysis.compare.TIERS`
      why: the measured errors, where they come from (both releases' source lines)
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from migrate.config import loading, safe_load
from migrate.config.bounds import INT_BOUNDS, MAX_PER_DEVICE_BATCH, short_repr
from migrate.errors import BadInput
from parity.analysis import compare
from parity.engine import registry
from parity.maxtext import build_envs
from parity.maxtext.mesh import (
    DCN,
    ICI,
    MESH_DEFAULTS,
    dcn_auto,
    devices_per_slice,
    num_slices,
    resolve_mesh,
)
from parity.reports.progress import progress
from parity.run_options import RunOptions

MAX_BYTES = 1 << 16
REQUIRED = ("per_device_batch_size", "max_target_length", "vocab_size")
# The releases the weight map knows, and where `make maxtext-envs` puts each one.
RELEASES = {"linen": "0.2.3", "nnx": "0.2.5"}
CHECKPOINT_STEPS = 3  # `checkpoint`: 0.2.3's train.py trains these, the last checkpointed
MAX_ICI = 512  # the mesh is simulated CPU devices
# The twins' bounds of the keys MaxText names alike, and MaxText's own size keys: inclusive,
# -1 where MaxText reads it as "derive it" (`pipeline_parallel_layers`, ...). The mesh axes
# are bounded apart (`violations`): MaxText's `dcn_*` take -1 ("the rest"), an `ici_*` axis
# of a simulated mesh at most `MAX_ICI` devices.
MAXTEXT_BOUNDS: dict[str, tuple[int, int]] = {
    **{k: v for k, v in INT_BOUNDS.items() if k != "seed" and not (ICI.match(k) or DCN.match(k))},
    "base_moe_mlp_dim": (-1, 2**18),  # -1: base_mlp_dim
    "global_parameter_scale": (1, 2**10),  # a power of two
    "first_num_dense_layers": (0, 2**10),
}
# MaxText's `DType` (0.2.3 and 0.2.5 alike), bytes per element; `mu_dtype` may also be empty
# (the weights' dtype).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
DTYPE_KEYS = ("dtype", "weight_dtype", "grad_dtype", "mu_dtype")
MATMUL_PRECISIONS = ("default", "high", "highest")


GATE_KEYS = ("tier", "why")  # a config's `gate:` mapping: both required


@dataclasses.dataclass(frozen=True)
class DeclaredTier:
    """A family's declared tier (a name of `compare.TIERS`) and why its releases differ."""

    tier: str
    why: str


@dataclasses.dataclass(frozen=True)
class MaxTextConfig:
    """What the harness needs of a MaxText gate run: the keys both sides build from, a name for
    reports, the device count of MaxText's mesh (the product of its `ici_*` axes), and the
    tier the config declares (None: bit-exact)."""

    model_name: str
    keys: dict[str, Any]
    num_devices: int
    declared: DeclaredTier | None = None
    # Every mesh axis MaxText builds (`ici_*`, `dcn_*` keys: the config's and MaxText's
    # defaults), a -1 filled as MaxText fills it (`resolve_mesh`); empty where not resolved.
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    filled: tuple[str, ...] = ()  # the axes of `mesh` that were -1 (the config's or MaxText's)

    @property
    def stages(self) -> int:
        return int(self.keys.get("ici_pipeline_parallelism", 1))

    def describe(self) -> str:
        shown = ", ".join(
            f"{k}={self.keys[k]}"
            for k in (
                "ici_pipeline_parallelism",
                "num_pipeline_microbatches",
                "num_pipeline_repeats",
                "num_layers_per_pipeline_stage",
                "base_num_decoder_layers",
            )
            if k in self.keys
        )
        mesh = " x ".join(
            f"{ICI.match(k)[1] if ICI.match(k) else 'dcn_' + DCN.match(k)[1]} {v}"
            for k, v in self.mesh.items()
            if v != 1
        )
        shown_filled = [k for k in self.filled if self.mesh[k] != 1 or k not in MESH_DEFAULTS]
        auto = ", ".join(f"{k}=-1 -> {self.mesh[k]}" for k in shown_filled)
        mesh = f" (mesh {mesh or 'one device'}{'; ' + auto if auto else ''})" if self.mesh else ""
        return f"MaxText {self.model_name}: {self.num_devices} devices{mesh}, {shown}"


def _read(path: Path) -> tuple[dict[str, Any], DeclaredTier | None]:
    """(the config's MaxText keys, its declared tier or None)."""
    text = safe_load.read_text(path, MAX_BYTES, "MaxText config")
    values = safe_load.load_yaml(text, str(path))
    if not isinstance(values, dict) or not isinstance(values.get("maxtext"), dict):
        raise BadInput(f"{path}: a MaxText config is a mapping with a `maxtext:` mapping of keys")
    unknown = sorted(set(values) - {"maxtext", "gate"})
    if unknown:
        raise BadInput(
            f"{path}: unknown top-level keys {unknown} (MaxText's go under maxtext:, the "
            "declared tier under gate:)"
        )
    return dict(values["maxtext"]), _declared(path, values["gate"]) if "gate" in values else None


def _declared(path: Path, gate: Any) -> DeclaredTier:
    """A `gate:` mapping read strictly: a known tier and a non-empty `why`, nothing else."""
    if not isinstance(gate, dict):
        raise BadInput(f"{path}: gate: must be a mapping of {', '.join(GATE_KEYS)}")
    unknown = sorted(str(k) for k in set(gate) - set(GATE_KEYS))
    if unknown:
        raise BadInput(f"{path}: gate: unknown keys {unknown} (known: {', '.join(GATE_KEYS)})")
    tier, why = gate.get("tier"), gate.get("why")
    if tier not in compare.TIERS:
        raise BadInput(
            f"{path}: gate: tier={short_repr(tier)}: must be one of {list(compare.TIERS)}"
        )
    if not isinstance(why, str) or not why.strip():
        raise BadInput(
            f"{path}: gate: tier {tier} needs `why`: the measured errors and their located cause"
        )
    return DeclaredTier(tier, " ".join(why.split()))


def load(
    path: str | Path,
    overrides: list[str],
    topology: str | None = None,
    num_slices_given: int | None = None,
) -> MaxTextConfig:
    """The base (`loading.base_config_path`), the config at `path` (or the shipped MaxText
    config of that name: `pp4`), then `key=value` overrides; BadInput names what is wrong.
    `topology` (and `num_slices_given`): the TPU slice a `--topology` run compiles for (its
    devices fill a -1 ICI axis, its slices a -1 DCN axis; what only the CPU refuses is left to
    it), else the simulated CPU devices (`resolve_mesh`)."""
    path = loading.resolve(path, "maxtext")
    if not path.exists() and not path.is_symlink():
        raise BadInput(loading.not_found(path, "maxtext"))
    base = loading.base_config_path(path, "maxtext")
    keys = _read(base)[0] if base.resolve() != path.resolve() else {}
    own, declared = _read(path)
    keys.update(own)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise BadInput(f"override {item!r}: expected key=value")
        keys[key] = safe_load.load_yaml(raw, f"override {key}") if raw else ""
    missing = [k for k in REQUIRED if k not in keys]
    if missing:
        raise BadInput(f"{path}: the MaxText config must set {', '.join(missing)}")
    problems = violations(keys)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise BadInput(f"{path}: {problems[0]}{more}")
    per_slice, slices = devices_per_slice(keys, topology, num_slices_given)
    mesh = resolve_mesh(keys, per_slice, slices, path)
    given = {**MESH_DEFAULTS, **keys}
    filled = tuple(k for k in mesh if given.get(k) == -1)
    ici = {k: v for k, v in mesh.items() if ICI.match(k)}
    devices = math.prod(ici.values())
    resolved = {**keys, **ici}
    if topology is None:  # the CPU's workers get the filled axes; on a slice each release fills
        keys = resolved  # its own, and compiles what the CPU cannot run
    cpu = None if topology is not None else cpu_problem(keys) or dcn_problem(mesh)
    for problem in (cpu, microbatch_problem(resolved, devices)):
        if problem is not None:
            raise BadInput(f"{path}: {problem}")
    if not 1 <= devices <= MAX_ICI:
        raise BadInput(f"{path}: the mesh needs {devices} devices; at most {MAX_ICI} simulated")
    if int(keys["per_device_batch_size"] * devices) < 1:
        raise BadInput(
            f"{path}: per_device_batch_size={keys['per_device_batch_size']} on {devices} "
            "devices: a global batch of no row"
        )
    return MaxTextConfig(Path(path).stem, keys, devices, declared, mesh, filled)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_problem(key: str, value: Any, low: int, high: int) -> str | None:
    """Why `value` is no integer in `low..high` (-1 meaning "derive it" where `low` is -1),
    or None; the key named, the value shortened."""
    if _is_int(value) and low <= value <= high:
        return None
    shown = f"{key}={short_repr(value)}"
    if low == 1 and _is_int(value) and value < 1:
        return f"{shown}: must be a positive integer"
    if low == -1:
        return f"{shown}: must be -1 or an integer in 1..{high}"
    return f"{shown}: must be an integer in {low}..{high}"


def violations(keys: dict[str, Any]) -> list[str]:
    """The known keys out of their bounds (`MAXTEXT_BOUNDS`, the mesh axes, the batch, the
    dtypes), in the config's order, then dropout asked for (`_dropout_problem`); empty when
    every one is in bounds."""
    out = []
    for key, value in keys.items():
        if key in MAXTEXT_BOUNDS:
            low, high = MAXTEXT_BOUNDS[key]
            problem = _int_problem(key, value, low, high)
            if problem is None and low == -1 and value == 0:
                problem = f"{key}=0: must be -1 or an integer in 1..{high}"
            if problem is None and key == "global_parameter_scale" and value & (value - 1):
                problem = f"{key}={value}: must be a power of two"
        elif ICI.match(key):  # -1: MaxText fills it with the slice's devices left
            problem = _int_problem(key, value, -1, MAX_ICI)
            if problem is None and value == 0:
                problem = f"{key}=0: must be -1 or a positive integer"
        elif DCN.match(key):
            problem = _int_problem(key, value, -1, INT_BOUNDS["dcn_data_parallelism"][1])
            if problem is None and value == 0:
                problem = f"{key}=0: must be -1 or a positive integer"
        elif key == "per_device_batch_size":
            problem = _batch_problem(value)
        elif key in DTYPE_KEYS:
            allowed = [*DTYPE_BYTES, *([""] if key == "mu_dtype" else [])]
            shown = f"{key}={short_repr(value)}"
            problem = None if value in allowed else f"{shown}: must be one of {allowed}"
        elif key == "matmul_precision":
            ok, allowed = value in MATMUL_PRECISIONS, list(MATMUL_PRECISIONS)
            problem = None if ok else f"{key}={short_repr(value)}: must be one of {allowed}"
        else:
            continue
        if problem is not None:
            out.append(problem)
    dropout = _dropout_problem(keys)
    return out if dropout is None else [*out, dropout]


def _dropout_problem(keys: dict[str, Any]) -> str | None:
    """Dropout asked of a gate whose runs are deterministic: the releases key their pipelines'
    masks by stage and iteration (0.2.5) or not at all (0.2.3's Linen pipeline), so no run of
    one lines up with the other's or with a twin's (docs/pipeline.md, "Dropout")."""
    rate = keys.get("dropout_rate", 0.0)
    if keys.get("enable_dropout", True) is False or (
        isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate == 0
    ):
        return None
    return (
        f"dropout_rate={short_repr(rate)}: the MaxText gate compares deterministic runs "
        "(the releases key their pipelines' dropout masks differently); the twins' dropout: "
        "parity CONFIG dropout_rate=R"
    )


def cpu_problem(keys: dict[str, Any]) -> str | None:
    """Why both releases would refuse to run `keys` on this CPU, where a key says it before any
    worker starts, or None. MaxText's mixture-of-experts layers default to its megablox kernel
    (`megablox: true` in both releases' base.yml), which runs on TPU and GPU only ("Only
    interpret mode is supported on CPU backend"); its dense path runs on the CPU."""
    experts = keys.get("num_experts", 1)
    if isinstance(experts, int) and experts > 1 and keys.get("megablox", True) is not False:
        return (
            f"num_experts={experts}: MaxText's megablox MoE kernel runs on TPU and GPU only; "
            "on the CPU set megablox=false sparse_matmul=false (the dense path: the releases "
            "agree bit for bit there, pp4 with 4 experts measured)"
        )
    return None


# XLA:CPU aborts a process (signal 6 in `AwaitAndLogIfStuck`) whose collective has waited past
# its terminate timeout: on a loaded 2-core host, both releases' workers running a pipeline
# loop with captures (a host callback per module, per stage, per iteration) beside a TPU compile
# were seen to. A worker's collective may wait as long as a call to it may run.
COLLECTIVE_WAIT_S = 1800


def worker_variables() -> dict[str, str]:
    """The environment a MaxText decoder worker runs with, beyond the caller's."""
    wait = f"--xla_cpu_collective_call_terminate_timeout_seconds={COLLECTIVE_WAIT_S}"
    return {
        "DECOUPLE_GCLOUD": "TRUE",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {wait}".strip(),
    }


def dcn_problem(mesh: dict[str, int]) -> str | None:
    """Why both releases refuse a mesh across slices on this CPU (one host, one slice: both
    stop in their config reader, "DCN parallelism requested but only one slice available"),
    or None. `--topology` compiles such a config for TPU slices."""
    across = {k: v for k, v in mesh.items() if DCN.match(k) and v > 1}
    if not across:
        return None
    axes = ", ".join(f"{k}={v}" for k, v in across.items())
    return (
        f"{axes}: MaxText lays DCN axes across TPU slices, and this CPU is one slice (both "
        "releases refuse it here); compile it for slices: --checks=compile --topology=NAME"
    )


# The mesh axes MaxText splits a pipeline microbatch over (its `activation_batch` rule in both
# releases' base.yml: data, fsdp, fsdp_transpose, expert), each ICI x DCN.
BATCH_AXES = ("data", "fsdp", "fsdp_transpose", "expert")


def microbatch_problem(keys: dict[str, Any], ici_devices: int) -> str | None:
    """Why a pipelined config's microbatches cannot split over the batch axes, or None
    (`ici_devices`: the product of the `ici_*` axes; the `dcn_*` ones multiply it): MaxText
    shards each microbatch (the global batch over `num_pipeline_microbatches`, -1: the stages)
    over `BATCH_AXES`, and both releases stop in a `shard_map` ("not evenly divisible") after
    the first checks have run."""
    size = lambda axis, kind: keys.get(f"{kind}_{axis}_parallelism", 1)
    axes = [size(a, k) for a in ("pipeline", *BATCH_AXES) for k in ("ici", "dcn")]
    if not all(isinstance(n, int) and n >= 1 for n in axes):
        return None  # a -1 (auto) axis: left to the releases
    stages = axes[0] * axes[1]
    if stages == 1:
        return None
    devices = ici_devices * math.prod(v for k, v in keys.items() if DCN.match(k) and _is_int(v))
    batch = int(keys["per_device_batch_size"] * devices)
    microbatches = keys.get("num_pipeline_microbatches", -1)
    microbatches = stages if microbatches == -1 else microbatches
    shards = math.prod(axes[2:])
    if not isinstance(microbatches, int) or microbatches < 1 or batch % microbatches:
        return None  # MaxText's own validation names it
    if (batch // microbatches) % shards:
        return (
            f"num_pipeline_microbatches={microbatches}: a microbatch of "
            f"{batch // microbatches} sequences (per_device_batch_size="
            f"{keys['per_device_batch_size']} x {devices} devices / {microbatches}) cannot split "
            f"over the batch axes data x fsdp x fsdp_transpose x expert ({shards}); raise "
            "per_device_batch_size or lower num_pipeline_microbatches"
        )
    return None


def _batch_problem(value: Any) -> str | None:
    shown = f"per_device_batch_size={short_repr(value)}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{shown}: must be a number"
    if not (math.isfinite(value) and 0 < value <= MAX_PER_DEVICE_BATCH):
        return f"{shown}: must be a number in (0, {MAX_PER_DEVICE_BATCH}]"
    return None


def default_python(framework: str) -> str | None:
    """The interpreter of `framework`'s release as `python -m parity.maxtext.build_envs`
    (or `make maxtext-envs`) built it, if it is there."""
    return build_envs.find_python(RELEASES[framework])


def environments(options: RunOptions) -> dict[str, Any]:
    """Each release's environment: `--{side}_python` (and `--{side}_path`), else the one
    `make maxtext-envs` built; BadInput when neither is there."""
    from parity.remote.client import check_interpreter
    from parity.remote.environments import Environment, checkout, require_module

    if options.num_processes > 1 or options.checkpoint is not None:
        raise BadInput("--maxtext runs in one process, on the releases' own initialisations")
    out = {}
    for side, release in RELEASES.items():
        given, path = options.sides.python(side), options.sides.path(side)
        python = given or default_python(side)
        if python is None:
            raise BadInput(
                f"--maxtext: no MaxText {release} environment for the {side} side; build it "
                f"with `python -m parity.maxtext.build_envs {release}` (in a checkout: `make "
                f"maxtext-envs`), or pass --{side}_python"
            )
        what = f"--{side}_python={given}" if given else f"the {side} side's interpreter {python}"
        out[side] = Environment(
            python=check_interpreter(python),
            path=checkout(path, f"{side}_path", ["parity/maxtext/decoder_factory.py"])
            if path
            else None,
            timeout_s=options.sides.worker_timeout_s,
        )
        paths = [out[side].path] if path else []
        require_module(out[side].python, "maxtext", what, paths, name="MaxText")
    return out


def still_running(worker: str, doing: str, seconds: float) -> None:
    """The progress line of a release's worker whose call runs long (building its model, a
    `train.py` run): a gate on a large model would be silent for minutes otherwise."""
    release = RELEASES.get(worker)
    who = f"the {worker} side (MaxText {release})" if release else f"worker {worker}"
    progress(f"{who}: {doing} still running after {seconds:.0f}s")


def runnable(selected: list[str], front: registry.Front) -> tuple[list[str], list[str]]:
    """(the selected checks this gate runs, those it cannot: the twins' own, that call the
    project's twins in the harness's process); BadInput when none is left to run."""
    cannot = [c for c in selected if not registry.get(c).runs_on(front)]
    runs = [c for c in selected if c not in cannot]
    if not runs:
        twins = [c for c in cannot if registry.get(c).runs_on(registry.Front.TWINS)]
        why = [f"{', '.join(twins)} call the project's twins in this process"] if twins else []
        why += [f"{c} does not run on {front.value}" for c in cannot if c not in twins]
        raise BadInput(
            f"--checks={','.join(selected)}: none of these runs with --maxtext "
            f"({'; '.join(why)}); --maxtext runs: {', '.join(registry.names(front))}"
        )
    return runs, cannot


# Run by a release's interpreter: why it cannot compile TPU programs ('' when it can).
_LIBTPU_PROBE = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from parity.tpu.topologies import libtpu_problem; print(libtpu_problem() or '')"
)


def check_tpu_environments(environments: dict[str, Any]) -> None:
    """Each release's environment can compile for a TPU (libtpu, as its jax names it), before
    any worker starts; BadInput naming the release and the command that installs it."""
    from parity.remote.client import project_path  # no JAX

    with tempfile.TemporaryDirectory(prefix="parity-libtpu-probe-") as scratch:
        packages = str(project_path(Path(scratch)))
        for side, env in environments.items():
            done = subprocess.run(
                [env.python, "-c", _LIBTPU_PROBE, packages],
                capture_output=True,
                text=True,
                timeout=60,
            )
            problem = done.stdout.strip() if done.returncode == 0 else done.stderr.strip()[-300:]
            if problem:
                raise BadInput(f"the {side} side (MaxText {RELEASES[side]}): {problem}")


def tpu_target(
    config: MaxTextConfig, selected: list[str], name: str | None, slices_given: int | None
) -> Any:
    """`parity --maxtext CONFIG --topology=name [--num_slices=N]` validated before any worker:
    each release's train_compile for the slice is the run's only check (the others run on the
    CPU, without it); the slices are the config's `dcn_*` axes' (a -1 takes the given count).
    The `parity.tpu.topologies.Target`, or None without the flag."""
    from parity.tpu import topologies  # no JAX

    if name is None:
        topologies.no_topology(slices_given)
        return None
    if list(selected) != ["compile"]:
        raise BadInput(
            "--topology with --maxtext: compiles each release's train step for the slice; "
            "run it as --checks=compile (the other checks run on the CPU, without --topology)"
        )
    spans = num_slices(config.keys)
    slices = slices_given or spans
    if slices != spans and not dcn_auto(config.keys):
        raise BadInput(
            f"--num_slices={slices}: the config's mesh spans {spans} slice(s) (the product "
            "of its dcn_* axes)"
        )
    topology = topologies.check(name, slices, config.num_devices * slices)
    return topologies.Target(topology, slices)
