"""The Flax module-pair adapter behind `compare_modules`: `Side`s for any Linen module and its
NNX port (`modules.py`, `module_base.py`), how they are called (`calls.py`), their arguments
checked before anything is traced (`pair_args.py`), the Linen module's execution order
(`order.py`), `nnx.bridge` layers under the capture (`bridges.py`), Flax's errors as one-line
hints (`hints.py`) and renames suggested from unmatched paths (`renames.py`)."""
