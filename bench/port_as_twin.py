"""The twins' Linen decoder ported by `migrate port`, put where the hand-written NNX twin
(`migrate/nnx/decoder.py`'s `Decoder`) stands, and judged by `parity` with the checks the
twins get: does the written port pass what the hand port passes?

    PYTHONPATH=. python bench/port_as_twin.py CONFIG [KEY=VALUE ...] [--checks=LIST]
    PYTHONPATH=. python bench/port_as_twin.py llama2-tiny dropout_rate=0.1 --checks=all

The port is written into a temporary folder (its gate not run: `parity` is the judge here);
every other part of the NNX side (its train step, its checkpoints' layout) is the twin's own.
Exits with `parity`'s status.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import importlib
import sys
import tempfile

from migrate.config.loading import resolve


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a shipped config's name (llama2-tiny) or path")
    parser.add_argument("overrides", nargs="*", help="config overrides, as parity takes them")
    parser.add_argument("--checks", default="default", help="parity's --checks")
    args = parser.parse_args()
    from migrate.linen import decoder as linen_decoder
    from migrate.nnx import decoder as nnx_decoder
    from migrate.port import command
    from parity import cli

    stem = os.path.basename(resolve(args.config)).removesuffix(".yml").replace("-", "_")
    with tempfile.TemporaryDirectory(prefix="port-as-twin-") as out:
        result = command.port(
            linen_decoder.Decoder, "int32[16,16]", out,
            fields_from=f"migrate.port.corpus:twin_{stem}", run_gate=False,
        )  # fmt: skip
        if result.stubs:
            print(f"the port left {len(result.stubs)} stub(s): {result.stubs[0]}")
            return 1
        sys.path.insert(0, out)
        written = importlib.import_module("decoder_nnx")
        nnx_decoder.Decoder = written.Decoder  # the written port where the hand twin stood
        print(f"parity with the NNX side's Decoder from {written.__file__}", flush=True)
        config = str(resolve(args.config))
        argv = cli.FLAGS(["parity", config, *args.overrides, f"--checks={args.checks}"])
        return cli.run(argv)


if __name__ == "__main__":
    sys.exit(main())
