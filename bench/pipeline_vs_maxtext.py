"""The project's pipeline twins against MaxText 0.2.5's `NNXPipeline`, side by side on the same
shapes: step time and compile time (median of interleaved rounds, with the spread), per-device
temp memory, and the collectives in each loop body.

    bench/maxtext/install.sh                       # once: MaxText in bench/.venv-maxtext
    .venv/bin/python bench/pipeline_vs_maxtext.py --rounds 9 --steps 20 --compiles 5

Each side runs in its own process (MaxText in its own virtual environment; see
`bench/maxtext/serve.py` for the protocol). The driver asks them for rounds in turn, rotating
who goes first, so that every side sees the same machine load. A ratio is ours over MaxText's,
computed per round from the round medians; the table gives the median ratio and the spread
(lowest and highest round ratio). Defaults: 4 stages, 1 layer per stage, 4 microbatches, emb 64,
vocab 256, seq 16, 4 simulated devices, float32, the iteration body checkpointed saving only its
input and the layer inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from parity.analysis import hlo  # noqa: E402

SHAPE_FLAGS = ("stages", "microbatches", "emb", "vocab", "seq", "per_device_batch")
SIDES = ("maxtext", "nnx", "linen")


class Worker:
    """One side's worker process: compiles at start, then answers `round` and `compile`."""

    def __init__(self, side: str, command: list[str], env: dict[str, str], log: Path) -> None:
        self.side = side
        self.log = log.open("w")
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.ready = self.answer()["ready"]

    def answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("{"):
                message = json.loads(line)
                if "error" in message:
                    raise RuntimeError(f"{self.side}: {message['error']}")
                return message
        raise RuntimeError(f"{self.side} worker exited; see {self.log.name}")

    def ask(self, command: str) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.answer()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
            self.process.wait(timeout=60)
        self.log.close()


def loop_collectives(hlo_path: Path, stages: int) -> dict[str, dict[str, int]]:
    """Collectives per loop body (forward, backward) by kind, across or within stages."""
    text = hlo_path.read_text()
    counts: dict[str, dict[str, int]] = {}
    for loop in hlo.loops(text):
        for collective in loop.collectives:
            spans_stages = collective.mesh_axes({"stage": stages}) != frozenset()
            key = f"{collective.kind}{'' if spans_stages else ' (within a stage)'}"
            per_kind = counts.setdefault(loop.direction, {})
            per_kind[key] = per_kind.get(key, 0) + 1
    return counts


def ratio_stats(ours: list[float], theirs: list[float]) -> tuple[float, float, float]:
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--compiles", type=int, default=5, help="interleaved compile rounds")
    parser.add_argument("--maxtext_python", default=str(ROOT / "bench/.venv-maxtext/bin/python"))
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--emb", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--per_device_batch", type=int, default=4)
    args = parser.parse_args()
    if not Path(args.maxtext_python).exists():
        sys.exit(f"no MaxText environment at {args.maxtext_python}: run bench/maxtext/install.sh")

    shape = [f"--{flag}={getattr(args, flag)}" for flag in SHAPE_FLAGS]
    workdir = Path(tempfile.mkdtemp(prefix="pipeline_vs_maxtext_"))
    base_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    commands = {
        "maxtext": [args.maxtext_python, "bench/maxtext/pipeline_worker.py"],
        "nnx": [sys.executable, "bench/pipeline_worker.py", "--framework=nnx"],
        "linen": [sys.executable, "bench/pipeline_worker.py", "--framework=linen"],
    }
    workers: dict[str, Worker] = {}
    try:
        for side in SIDES:  # one at a time: the start-up compiles do not compete
            env = base_env | ({"DECOUPLE_GCLOUD": "TRUE"} if side == "maxtext" else {})
            hlo_path = workdir / f"{side}.hlo"
            command = [*commands[side], *shape, f"--steps={args.steps}", f"--hlo={hlo_path}"]
            workers[side] = Worker(side, command, env, workdir / f"{side}.log")
        compile_s: dict[str, list[float]] = {side: [] for side in SIDES}
        step_ms: dict[str, list[float]] = {side: [] for side in SIDES}
        for r in range(max(args.rounds, args.compiles)):
            order = SIDES[r % 3 :] + SIDES[: r % 3]
            for side in order:
                if r < args.compiles:
                    compile_s[side].append(workers[side].ask("compile")["compile_s"])
                if r < args.rounds:
                    times = workers[side].ask("round")["times"]
                    step_ms[side].append(1e3 * statistics.median(times))
    finally:
        for worker in workers.values():
            worker.close()

    print(f"shape: {' '.join(shape)}; {args.rounds} rounds of {args.steps} steps, ")
    print(f"{args.compiles} compile rounds; jax {workers['maxtext'].ready['jax']}\n")
    print("| side | step ms (median of rounds) | step ratio ours/MaxText (spread) |")
    print("| --- | ---: | --- |")
    for side in SIDES:
        median = statistics.median(step_ms[side])
        if side == "maxtext":
            print(f"| MaxText 0.2.5 NNXPipeline | {median:.2f} | 1 |")
            continue
        mid, low, high = ratio_stats(step_ms[side], step_ms["maxtext"])
        print(f"| ours ({side}) | {median:.2f} | {mid:.3f} ({low:.3f}-{high:.3f}) |")
    print("\n| side | compile s (median) | compile ratio (spread) | temp bytes | argument bytes |")
    print("| --- | ---: | --- | ---: | ---: |")
    for side in SIDES:
        ready = workers[side].ready
        median = statistics.median(compile_s[side])
        if side == "maxtext":
            ratio = "1"
        else:
            mid, low, high = ratio_stats(compile_s[side], compile_s["maxtext"])
            ratio = f"{mid:.3f} ({low:.3f}-{high:.3f})"
        print(
            f"| {side} | {median:.2f} | {ratio} | {ready['temp_bytes']:,} | "
            f"{ready['argument_bytes']:,} |"
        )
    print("\n| side | loop body forward | loop body backward |")
    print("| --- | --- | --- |")
    for side in SIDES:
        counts = loop_collectives(workdir / f"{side}.hlo", args.stages)
        cells = [
            ", ".join(f"{k} {n}" for k, n in sorted(counts.get(d, {}).items())) or "none"
            for d in ("forward", "backward")
        ]
        print(f"| {side} | {cells[0]} | {cells[1]} |")
    print(f"\nlogs and optimised HLO: {workdir}")


if __name__ == "__main__":
    main()
