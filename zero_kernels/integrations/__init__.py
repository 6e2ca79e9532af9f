"""Front doors for the trainers people use: each module imports its framework only when it is
itself imported, so ``zero_kernels.integrations.lightning`` works without transformers installed
and the other way round.

- `zero_kernels.integrations.transformers.ZeroTrainer`: a Hugging Face ``Trainer`` taking
  ``zero={"stage": 3, ...}``;
- `zero_kernels.integrations.lightning.ZeroStrategy`: a Lightning strategy (``lightning`` or
  ``pytorch_lightning``), registered as ``zero_kernels_stage_1/2/3``;
- `zero_kernels.integrations.accelerate`: ``prepare`` with an ``Accelerator`` that keeps the model
  out of DDP, and ``save_state``/``load_state``; ``prepare(..., zero="ds_config.json")`` reads
  a DeepSpeed config as accelerate's DeepSpeed plugin does
  (`zero_kernels.integrations.accelerate_ds`).

What they share (turning a plain torch optimizer into a `ZeroOptimizer`, the ``zero=`` argument,
whole-tensor saves of a sharded model) is in `zero_kernels.integrations.common`.
"""
