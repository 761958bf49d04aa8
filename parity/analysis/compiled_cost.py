"""What one compiled program costs per device: memory (arguments, temporaries, outputs, the
bytes donation aliases), FLOPs, bytes accessed, collectives in and outside its loops, and how
its compile time was obtained; read from any compiled program (the twins', a MaxText release's,
XLA:TPU's), and the margin within which one side may cost more than the other."""

from __future__ import annotations

import dataclasses

from parity.analysis import hlo
from parity.engine import compiles

# NNX may not cost more than Linen: temp memory, FLOPs and argument/output bytes of the compiled
# train step within 1% (the twins compile to the same program today, so the measured ratios are
# exactly 1.00; the margin only absorbs benign differences in XLA's bookkeeping).
COST_TOLERANCE = 0.01
DIRECTIONS = ("forward", "backward")  # of a pipeline's loops and their collectives


@dataclasses.dataclass(frozen=True)
class CompiledCost:
    """Per-device memory (bytes), cost and collectives of one compiled program."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    flops: float
    bytes_accessed: float
    collectives: dict[str, int]
    compile_seconds: float
    program: str  # hlo.program_fingerprint of the optimised module
    loops: tuple[hlo.Loop, ...] = ()  # outermost while loops, with their bodies' collectives
    alias_bytes: int = 0  # argument bytes whose buffers the outputs reuse (donated state)
    # (direction, collective) of everything outside the loops: among them, the reshards into
    # and out of the pipeline (`axes.INTO_PIPELINE`, `axes.OUT_OF_PIPELINE`)
    outside_loops: tuple[tuple[str, hlo.Collective], ...] = ()

    @property
    def peak_bytes(self) -> int:
        """What the step needs resident per device: its arguments, temporaries and outputs,
        less the outputs written into donated argument buffers."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    # how `compile_seconds` was obtained: "compiled in ...", or a persistent-cache read
    compile_source: str = ""
    # the reshards the SPMD partitioner could not express (it replicated the tensor instead)
    remats: tuple[compiles.Remat, ...] = ()
    # the compiler's estimate of one step's seconds (XLA:TPU's `optimal_seconds`; 0 where the
    # backend gives none, as XLA:CPU)
    optimal_seconds: float = 0.0

    @classmethod
    def of(
        cls,
        compiled,
        compile_seconds: float,
        compile_source: str = "",
        remats: tuple[compiles.Remat, ...] = (),
    ) -> CompiledCost:
        memory = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        text = compiled.as_text()
        return cls(
            argument_bytes=int(memory.argument_size_in_bytes),
            output_bytes=int(memory.output_size_in_bytes),
            temp_bytes=int(memory.temp_size_in_bytes),
            generated_code_bytes=int(memory.generated_code_size_in_bytes),
            flops=float(cost.get("flops", 0.0)),
            bytes_accessed=float(cost.get("bytes accessed", 0.0)),
            collectives=hlo.collective_counts(text),
            compile_seconds=compile_seconds,
            program=hlo.program_fingerprint(text),
            loops=tuple(hlo.loops(text)),
            alias_bytes=int(memory.alias_size_in_bytes),
            outside_loops=tuple(hlo.outside_loops(text)),
            compile_source=compile_source or f"compiled in {compile_seconds:.1f}s",
            remats=remats,
            optimal_seconds=float(cost.get("optimal_seconds", 0.0)),
        )
