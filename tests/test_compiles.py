"""What a run's compiles cost and what the compiler says while compiling
(`parity.engine.compiles`): each distinct program compiled once, a persistent-cache read
reported as one, and the SPMD partitioner's involuntary rematerialisations captured."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from parity.engine import compiles

pytestmark = pytest.mark.compat  # the oldest stack's layer (README, Stacks)

MESH = Mesh(np.array(jax.devices()).reshape(4, 2), ("stage", "fsdp"))


def _embedding_gradient(gather_table: bool, scale: float = 1.0) -> jax.stages.Lowered:
    """The gradient of an embedding lookup into a table split over (stage, fsdp), its rows'
    cotangent split over fsdp: the decoder's layout at a small scale. `gather_table`: the
    lookup reads the table gathered over fsdp (the twins' layout)."""

    def loss(table, tokens):
        if gather_table:
            table = jax.lax.with_sharding_constraint(table, NamedSharding(MESH, P("stage")))
        rows = jnp.take(table, tokens, axis=0)
        rows = jax.lax.with_sharding_constraint(rows, NamedSharding(MESH, P("fsdp")))
        return jnp.sum(jnp.tanh(rows * scale))

    table_sharding = NamedSharding(MESH, P("stage", "fsdp"))
    step = jax.jit(
        jax.grad(loss),
        in_shardings=(table_sharding, NamedSharding(MESH, P("fsdp"))),
        out_shardings=table_sharding,
    )
    return step.lower(
        jax.ShapeDtypeStruct((256, 64), jnp.float32),
        jax.ShapeDtypeStruct((16, 16), jnp.int32),
    )


def test_a_program_lowered_twice_compiles_once():
    with compiles.measure() as cost:
        first, first_shared = compiles.compile_once(_embedding_gradient(True, 2.0))
        again, again_shared = compiles.compile_once(_embedding_gradient(True, 2.0))
        other, _ = compiles.compile_once(_embedding_gradient(True, 3.0))
    assert not first_shared and again_shared and again is first
    assert other is not first  # another constant: another program
    assert cost.compilations == 2, cost.programs


def test_a_persistent_cache_read_is_said_plainly_with_the_warnings_its_compile_recorded():
    """JAX decides once per process whether it uses the persistent cache; a read is reported
    as a read, with the partitioner's warnings as the compile that wrote the entry recorded
    them, and a compile asked to be real never is a read."""
    compiles.compile_once(_embedding_gradient(False, 5.0))  # the cache entry
    real = compiles.compile_for_real(_embedding_gradient(False, 5.0))  # records the warnings
    assert not real.cache_read and real.describe().startswith("compiled in ")
    compiles.forget_programs()
    jax.clear_caches()
    lowered = _embedding_gradient(False, 5.0)  # a new lowering: no executable attached
    read, _ = compiles.compile_once(lowered, warnings=True)
    if not read.cache_read:
        pytest.skip("this process does not use a persistent compilation cache")
    assert read.describe().startswith("read from the persistent compilation cache in ")
    assert read.remats == real.remats  # as recorded (none on jax 0.10.2)
    assert compiles.compile_once(lowered, warnings=True) == (read, True)  # now shared


def test_the_partitioners_involuntary_rematerialisations_are_captured_off_the_terminal(capfd):
    """The table split over fsdp makes the gradient's scatter want its rows split over embed;
    from the rows' split over fsdp the partitioner cannot reshard, and replicates them. Read
    from the table gathered over fsdp (the twins' layout), nothing is replicated."""
    replicated = compiles.compile_for_real(_embedding_gradient(False))
    gathered = compiles.compile_for_real(_embedding_gradient(True))
    assert gathered.remats == ()
    if not replicated.remats:
        # jax 0.10.2's partitioner resolves this reshard without the warning.
        assert jax.__version_info__ < (0, 12), "the seeded reshard announced nothing"
        pytest.skip(f"jax {jax.__version__}'s partitioner announces no rematerialisation here")
    remat = replicated.remats[0]
    assert remat.dtype == "f32" and remat.operation.startswith("%")
    assert remat.bytes == math.prod(remat.shape) * 4 > 0
    assert "'fsdp'" in remat.source and "last_tile_dim_replicate" in remat.target
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


def test_remat_warnings_are_parsed_with_tensor_shardings_and_bytes():
    line = (
        "W1201 spmd_partitioner.cc:666] [SPMD] Involuntary full rematerialization. The compiler "
        "cannot go from sharding {mesh['stage'=4,'fsdp'=2], [{'fsdp', 'stage'}, {}, {}]} to "
        "{devices=[1,1,2,4]<=[4,2]T(1,0) last_tile_dim_replicate} efficiently for HLO "
        "operation %fake_parameter.2 = bf16[2,4096,4096]{2,1,0} parameter(2), sharding=..."
    )
    (remat,) = compiles.parse_remats(f"unrelated\n{line}\n")
    assert remat.shape == (2, 4096, 4096) and remat.bytes == 2 * 4096 * 4096 * 2
    assert remat.source == "{mesh['stage'=4,'fsdp'=2], [{'fsdp', 'stage'}, {}, {}]}"
    assert remat.target.startswith("{devices=[1,1,2,4]")


EXIT_LOST_WORKER = """
import sys
from migrate.runtime import cli_support
from parity.engine import compiles
print(compiles.use_compilation_cache(""), flush=True)
cli_support.exit_now(int(sys.argv[1]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("status", [0, 3])
def test_the_runs_own_cache_is_removed_however_the_run_exits(status, tmp_path):
    """`--compilation_cache_dir=''`: the run's own temporary cache is removed at a normal exit
    and at the prompt exit of a lost worker (exit 3), which skips the interpreter's hooks."""
    done = subprocess.run(
        [sys.executable, "-c", EXIT_LOST_WORKER, str(status)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == status, done.stderr[-2000:]
    made = Path(done.stdout.strip())
    assert made.parent == tmp_path and made.name.startswith("parity-run-cache-")
    assert not made.exists()
