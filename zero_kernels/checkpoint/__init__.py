"""Checkpoints: save at any world size and stage, load at any other; crash-safe, verified.

- `save_checkpoint` / `load_checkpoint`: the training state (params at full precision, optimizer
  state, hyper-parameters, scheduler, loss scaler, RNG states, the user's ``extra``), one
  safetensors file per rank plus JSON metadata; see [Note: checkpoint format] in `.format`.
- `inspect_checkpoint`, `verify_checkpoint`, `export_model`: what ``zero-kernels checkpoint``
  runs (no process group needed).
- `CheckpointError`: a checkpoint that cannot be loaded, naming the file and the problem.
"""

from .export import export_model, inspect_checkpoint, verify_checkpoint
from .format import FORMAT_VERSION, CheckpointError
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "export_model",
    "inspect_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]
