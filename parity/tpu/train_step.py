"""A whole train step compiled by XLA:TPU for a slice, from its lowering on the topology's
compile-only devices (a twin's: `parity.decoder.cost.lower_train_step`): its per-device cost
(`CompiledCost`), or, where the compiler refuses it for HBM, the compiler's own words
(`Overflow`). Nothing runs on a TPU.
"""

from __future__ import annotations

import dataclasses
import re
import time

import jax

from parity.analysis.compiled_cost import CompiledCost
from parity.engine import compiles
from parity.tpu.compile_devices import LIBTPU_NOISE

# XLA:TPU's refusal: "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM,
# the total memory required for HLO temporaries (352.00G) exceeds available HBM (95.73G)".
_OVERFLOW = re.compile(r"RESOURCE_EXHAUSTED|HbmOom|Ran out of memory")
# or, after its memory-pressure rematerialisation: "Ran out of memory in memory space hbm. Used
# 15.75G of 15.75G hbm. Exceeded hbm capacity by 1.15M."
_REQUIRED = re.compile(r"required for ([^(]*?)\s*\(([\d.]+[KMGT]?)\)")
_AVAILABLE = re.compile(r"available HBM \(([\d.]+[KMGT]?)\)")
_EXCEEDED = re.compile(r"of ([\d.]+[KMGT]?) hbm\. Exceeded hbm capacity by ([\d.]+[KMGT]?)")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _size(text: str) -> int:
    return int(float(text.rstrip("KMGT")) * _UNITS[text[-1] if text[-1] in "KMGT" else ""])


@dataclasses.dataclass(frozen=True)
class Overflow:
    """A train step XLA:TPU refused to compile because one device's HBM cannot hold it."""

    framework: str
    message: str  # the compiler's words, its first line
    what: str  # what did not fit, in its words ("HLO temporaries")
    required_bytes: int | None  # as the compiler rounds them
    available_bytes: int | None

    @classmethod
    def of(cls, framework: str, error: Exception) -> Overflow:
        text = str(error).strip()
        first = text.splitlines()[0] if text else type(error).__name__
        if exceeded := _EXCEEDED.search(text):
            capacity = _size(exceeded[1])
            return cls(framework, first, "the program", capacity + _size(exceeded[2]), capacity)
        required, available = _REQUIRED.search(text), _AVAILABLE.search(text)
        return cls(
            framework,
            first,
            required[1].strip() if required else "",
            _size(required[2]) if required else None,
            _size(available[1]) if available else None,
        )


@dataclasses.dataclass(frozen=True)
class SliceProgram:
    """One twin's train step for a slice: lowered, compiled (None where the compiler refused
    it), and its cost or the refusal."""

    lowered: jax.stages.Lowered
    executable: jax.stages.Compiled | None
    cost: CompiledCost | Overflow


def compile_step(lowered: jax.stages.Lowered, framework: str) -> SliceProgram:
    """The train step compiled for the TPU devices of `mesh`, never through the persistent
    cache (XLA:TPU executables of compile-only devices are not kept); the partitioner's
    warnings read as on the CPU. A compile the chip's HBM cannot hold is an `Overflow`; any
    other compiler error propagates (an internal error, not a finding)."""
    # XLA:TPU executables of compile-only devices cannot be read back (no TPU client): a
    # minimum compile time no compile reaches keeps them out of the persistent cache, so no
    # later run tries to.
    previous = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    start = time.perf_counter()
    try:
        with compiles.compiler_output(LIBTPU_NOISE) as output:
            compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as error:
        if _OVERFLOW.search(str(error)):
            return SliceProgram(lowered, None, Overflow.of(framework, error))
        raise
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", previous)
    seconds = time.perf_counter() - start
    remats = compiles.parse_remats("\n".join(output))
    found = CompiledCost.of(compiled, seconds, f"XLA:TPU compiled in {seconds:.1f}s", remats)
    return SliceProgram(lowered, compiled, found)
