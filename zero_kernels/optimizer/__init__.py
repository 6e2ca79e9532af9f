"""`ZeroOptimizer` (the facade, `zero_kernels.optimizer.zero_optimizer`) and its parts:
the built `core`, the named construction steps of `build`, the checks of `validate`, and
the parts over the core (`grad_access`, `param_access`, `state_access`, `sharded_state`,
`stepper`, `join`, `replicas`, `regroup`, `loss_scale`, `memory`, `wrappers`; [Note:
parts] in `zero_kernels.optimizer.core`)."""

from .zero_optimizer import ZeroOptimizer

__all__ = ["ZeroOptimizer"]
