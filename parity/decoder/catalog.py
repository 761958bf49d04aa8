"""The checks a `parity CONFIG` run can select: their names in run order, one line on what each
compares, which run only on request, and the command's exit statuses. No JAX: the command
validates `--checks` and prints `--help` before JAX starts."""

from __future__ import annotations

CHECKS: dict[str, str] = {
    "roundtrip": "Linen -> NNX -> Linen, NNX -> Linen -> NNX and pipeline <-> reference layouts: "
    "bit-exact, same dtypes",
    "init": "each twin's own initialisation: names, shapes, dtypes, and each parameter's "
    "distribution within 6 standard errors",
    "forward": "logits and loss, NNX against Linen, from either twin's initial weights: bit-exact",
    "grads": "every gradient leaf and the global gradient norm, NNX against Linen: bit-exact",
    "sharding": "per parameter: logical names, resolved PartitionSpec, placement; the compiled "
    "train steps' input and output shardings",
    "program": "both train steps compared instruction by instruction, before and after XLA's "
    "optimisation",
    "pipeline": "pipelined against the non-pipelined reference, in each twin: loss, logits, "
    "every gradient (calibrated float32 tier)",
    "bubbles": "NaN in every pipeline slot no stage has written yet: no NaN reaches an output "
    "or gradient, results bit-identical",
    "train": "--steps AdamW steps of the jitted train steps: loss, grad norm, every parameter "
    "and optimizer leaf at every step",
    "layers": "drill-down in data-flow order (embedding, every layer's submodules, pipeline "
    "iterations, head): the first divergence",
    "compile": "the train steps compiled from abstract inputs (no weights): per-device memory, "
    "FLOPs, collectives per loop body",
    "efficiency": "the compiled pipeline's matmul work against the useful work and the schedule's "
    "theory (M*R + d*(S-1)) / (M*R)",
}
CHECK_NAMES: tuple[str, ...] = tuple(CHECKS)
# Run only when asked (or, for layers, by itself when forward or grads fails). `compile` is the
# one check that never allocates weights: `--checks=compile` works for the 7B config.
ON_REQUEST = ("layers", "compile", "efficiency")
ABSTRACT_CHECKS = ("compile", "efficiency")  # compile from shapes: no weights allocated
# The checks that call the twins' functions in the harness's process (pipeline against
# reference, bubbles, the drill-down, compile and efficiency from abstract shapes): not
# available when the sides run in workers.
LOCAL_ONLY = ("pipeline", "bubbles", "layers", "compile", "efficiency")
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
