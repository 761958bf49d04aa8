"""`migrate port` on code it was not written against, one row per module: the twins' Linen
modules, recurrentgemma's Flax Linen model (every layer, then the whole Griffin) and MaxText
0.2.3's Linen decoder layer. Each row: what was ported, the stubs left, the gate's verdict and
the time (trace, writing, gate). The table of docs/port.md.

    PYTHONPATH=. python bench/port_corpus.py [--site DIR] [--maxtext_site DIR] [--only TEXT]
    PYTHONPATH=. python bench/port_corpus.py --configs    # the twins' decoder on each config

recurrentgemma's rows need it installed (`pip install --no-deps --target DIR
recurrentgemma==1.0.1 einops jaxtyping wadler_lindig typeguard==2.13.3 sentencepiece`, then
`--site DIR`); MaxText's need its 0.2.3 environment (`make maxtext-envs`), whose packages go
last on the path (its jax and flax are the project's pins). A row whose package is missing is
listed as skipped. Every row runs in this process, one port after another, on 8 simulated CPU
devices (16 for `llama2-tiny-4d`: `XLA_FLAGS=--xla_force_host_platform_device_count=16`); the
output folders are temporary. `--configs` ports the twins' whole Linen decoder, pipelined and as
the reference, on every shipped tiny config instead.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import importlib
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MAXTEXT_SITE = ROOT / ".venv-maxtext-0.2.3" / "lib" / "python3.12" / "site-packages"
CORPUS = "migrate.port.corpus"


@dataclasses.dataclass(frozen=True)
class Row:
    """One module of the corpus and how it is ported."""

    group: str
    target: str  # MODULE:CLASS
    inputs: str
    fields: Mapping[str, Any] | Callable[[], Mapping[str, Any]] = dataclasses.field(
        default_factory=dict
    )
    fields_from: str | None = None
    call_kwargs: tuple[Mapping[str, Any], ...] = ({},)
    method: str | None = None
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.target.split(":")[1]


def _rg(name: str, **fields: Any) -> Callable[[], Mapping[str, Any]]:
    """Fields naming recurrentgemma's enums, built once it is importable."""

    def build() -> Mapping[str, Any]:
        from recurrentgemma import common

        kinds = {"recurrent": common.TemporalBlockType.RECURRENT}
        kinds["attention"] = common.TemporalBlockType.ATTENTION
        return {**fields, "temporal_block_type": kinds[name]} if name else fields

    return build


TWINS = "migrate.linen"
RG = "recurrentgemma.jax"
X, POS = "float32[2,5,8]", "int32[2,5]"
ROWS = (
    Row("twins", f"{TWINS}.layers:DecoderLayer", "float32[2,16,64];int32[2,16]",
        fields_from=f"{CORPUS}:llama2_tiny", label="DecoderLayer (llama2-tiny)"),
    Row("twins", f"{TWINS}.layers:DecoderLayer", "float32[2,16,64];int32[2,16]",
        fields_from=f"{CORPUS}:mixtral_tiny", label="DecoderLayer (mixtral-tiny, MoE)"),
    Row("twins", f"{TWINS}.layers:Embed", "int32[2,16]", fields_from=f"{CORPUS}:llama2_tiny"),
    Row("twins", f"{TWINS}.decoder:Decoder", "int32[16,16]",
        fields_from=f"{CORPUS}:llama2_tiny", label="Decoder (pipelined)"),
    Row("twins", f"{TWINS}.decoder:Decoder", "int32[16,16]",
        fields_from=f"{CORPUS}:llama2_tiny_reference", label="Decoder (reference)"),
    Row("recurrentgemma", f"{RG}.layers:RMSNorm", X, {"width": 8}),
    Row("recurrentgemma", f"{RG}.layers:BlockDiagonalLinear", X,
        {"width_input": 8, "num_blocks": 2}),
    Row("recurrentgemma", f"{RG}.layers:Einsum", X,
        {"w_shape": (8, 4), "b_shape": (4,), "eqn": "...d,df->...f"}),
    Row("recurrentgemma", f"{RG}.layers:Conv1D", f"{X};{POS}", {"width": 8, "temporal_width": 4}),
    Row("recurrentgemma", f"{RG}.layers:RGLRU", f"{X};{POS}", {"width": 8, "num_heads": 2}),
    Row("recurrentgemma", f"{RG}.modules:MLPBlock", X, {"width": 8, "expanded_width": 16}),
    Row("recurrentgemma", f"{RG}.modules:LocalAttentionBlock", f"{X};{POS}",
        {"width": 8, "num_heads": 2, "window_size": 4}),
    Row("recurrentgemma", f"{RG}.modules:RecurrentBlock", f"{X};{POS}",
        {"width": 8, "num_heads": 2, "lru_width": 8, "conv1d_temporal_width": 4}),
    Row("recurrentgemma", f"{RG}.modules:Embedder", "int32[2,5]",
        {"vocab_size": 16, "embed_dim": 8, "scale_by_sqrt_dim": True}, method="encode"),
    Row("recurrentgemma", f"{RG}.modules:ResidualBlock", f"{X};{POS}",
        _rg("recurrent", width=8, mlp_expanded_width=16, num_heads=2, attention_window_size=4),
        label="ResidualBlock (recurrent)"),
    Row("recurrentgemma", f"{RG}.modules:ResidualBlock", f"{X};{POS}",
        _rg("attention", width=8, mlp_expanded_width=16, num_heads=2, attention_window_size=4),
        label="ResidualBlock (attention)"),
    Row("recurrentgemma", f"{RG}.griffin:Griffin", "int32[2,5];int32[2,5]",
        fields_from=f"{CORPUS}:griffin_tiny", call_kwargs=({"return_cache": False},)),
    Row("maxtext 0.2.3", "maxtext.layers.decoders:DecoderLayer",
        "float32[8,16,64];int32[8,16];int32[8,16]",
        fields_from=f"{CORPUS}:maxtext_decoder_layer",
        call_kwargs=({"deterministic": True, "model_mode": "train"},)),
)  # fmt: skip


def config_rows() -> tuple[Row, ...]:
    """The twins' decoder, pipelined and as the reference, on each shipped tiny config."""
    names = sorted(p.stem for p in (ROOT / "configs").glob("*-tiny*.yml"))
    return tuple(
        Row(f"twins ({name})", f"{TWINS}.decoder:Decoder", "int32[16,16]",
            fields_from=f"{CORPUS}:twin_{name.replace('-', '_')}{suffix}",
            label=f"Decoder ({kind})")
        for name in names
        for kind, suffix in (("pipelined", ""), ("reference", "_reference"))
    )  # fmt: skip


def run(row: Row, out: Path) -> dict[str, Any]:
    """Port `row` into `out`; what came of it."""
    from migrate.errors import BadInput
    from migrate.port import command

    module_name, class_name = row.target.split(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except ImportError as error:
        return {"result": f"skipped ({error.name} not installed)"}
    fields = row.fields() if callable(row.fields) else row.fields
    module = cls(**fields) if fields else cls
    started = time.perf_counter()
    try:
        result = command.port(
            module, row.inputs, out, call_kwargs=row.call_kwargs,
            fields_from=row.fields_from, method=row.method,
        )  # fmt: skip
    except BadInput as error:
        return {"result": f"refused: {error}", "seconds": time.perf_counter() - started}
    report = result.gate.report.splitlines()
    return {
        "result": "PASS" if result.status == 0 else (report[-1] if report else "FAIL"),
        "classes": sum(c.emitted is not None for c in result.classes),
        "bridged": [c.cls.__name__ for c in result.classes if c.emitted is None],
        "stubs": len(result.stubs),
        "files": 1 + len(result.other_files),
        "seconds": dict(result.seconds),
        "where": next((line.split()[-1] for line in report if " FAIL " in line), ""),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", help="a folder holding recurrentgemma and its imports")
    parser.add_argument("--maxtext_site", default=str(MAXTEXT_SITE))
    parser.add_argument("--only", help="the rows whose group, target or label contains this")
    parser.add_argument("--configs", action="store_true", help="the twins on every config")
    args = parser.parse_args()
    if args.site:
        sys.path.insert(0, args.site)
    if Path(args.maxtext_site).is_dir():
        os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
        sys.path.append(args.maxtext_site)  # last: the project's own packages first
    print("| group | module | result | classes ported | bridged | stubs | trace, write, gate (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="port-corpus-") as scratch:
        for i, row in enumerate(config_rows() if args.configs else ROWS):
            if args.only and args.only not in f"{row.group} {row.target} {row.label}":
                continue
            found = run(row, Path(scratch) / str(i))
            seconds = found.get("seconds", {})
            times = (
                ", ".join(f"{v:.2f}" for v in seconds.values())
                if isinstance(seconds, dict)
                else f"{seconds:.2f}"
            )
            bridged = ", ".join(found.get("bridged", [])) or "-"
            print(
                f"| {row.group} | {row.name} | {found['result']} | {found.get('classes', '-')} "
                f"| {bridged} | {found.get('stubs', '-')} | {times} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
