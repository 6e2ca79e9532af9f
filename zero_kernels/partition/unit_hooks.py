"""The module and gradient hooks through which torch calls stage 3's unit scheduler
(`zero_kernels.partition.units.UnitScheduler`). Each holds a weak reference to the scheduler, so
the hooks of one that was dropped do nothing, and each module hook runs as Python where
torch.compile traces the model ([Note: torch.compile] in `zero_kernels.partition.units`)."""

from __future__ import annotations

import torch


def _opaque(hook):
    """The hook, run as Python where torch.compile traces the model."""
    return torch.compiler.disable(hook, recursive=True)


def _pre(me, k, member: bool = False):
    """Unit ``k``'s forward pre-hook (``member``: on a member of container unit ``k``)."""

    def hook(module, args, kwargs=None):
        s = me()
        if s is not None:
            (s.member_pre if member else s.pre_forward)(k)
            s.push_recast(k)
            s.watch_inputs(k, args, kwargs)

    return _opaque(hook)


def _post(me, k, member: bool = False):
    def hook(module, args, output):
        s = me()
        if s is not None:
            s.pop_recast(k)
            s.post_forward(k, output, free=not member)

    return _opaque(hook)


def _root_pre(me):
    def hook(module, args, kwargs):
        s = me()
        if s is not None:
            s.root_pre(args, kwargs)

    return _opaque(hook)


def _root_member(me, name):
    def hook(module, args):
        s = me()
        if s is not None:
            s.root_member(name)

    return _opaque(hook)


def _root_post(me):
    def hook(module, args, output):
        s = me()
        if s is not None:
            s.root_post(output)

    return _opaque(hook)


def _root_finally(me):
    """Also after a forward that raised: the read guard off the mode stack."""

    def hook(module, args, output):
        s = me()
        if s is not None:
            s._guard.pop()

    return _opaque(hook)


def _root_bwd(me):
    def hook(grad):
        s = me()
        if s is not None:
            s.phase.enter_backward()
            s.wait(s.root)

    return hook


def _grad_hook(me, method: str, k: int):
    """A gradient hook calling the scheduler's ``method(k)`` (a unit's backward starts:
    ``pre_backward``; its inputs' gradients are computed: ``inputs_done``)."""

    def hook(grad):
        s = me()
        if s is not None:
            getattr(s, method)(k)

    return hook
