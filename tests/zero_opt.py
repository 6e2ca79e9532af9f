"""`zero_opt`: a `ZeroOptimizer` from flat option names, for tests that sweep options.

``zero_opt(model, AdamW, stage=3, bucket_size_mb=0.001, lr=1e-2)`` is
``ZeroOptimizer(model, AdamW, policy=ZeroPolicy.resolve(stage=3, bucket_size_mb=0.001),
lr=1e-2)``: the policy fields go to `ZeroPolicy.resolve`, the constructor's keywords and the
inner optimizer's hyper-parameters to the constructor. With ``policy=`` (or no flat field) the
arguments go to the constructor as they are, so its own errors are what a test sees.
"""

from zero_kernels import ZeroOptimizer
from zero_kernels.policy import ZeroPolicy, option_owner


def zero_opt(params, optimizer_class, *, stage=None, **kw):
    flat = {k: kw.pop(k) for k in list(kw) if option_owner(k) is not None}
    if "policy" in kw or not flat:
        if stage is not None:
            kw["stage"] = stage
        return ZeroOptimizer(params, optimizer_class, **kw, **flat)
    policy = ZeroPolicy.resolve(2 if stage is None else stage, **flat)
    return ZeroOptimizer(params, optimizer_class, policy=policy, **kw)
