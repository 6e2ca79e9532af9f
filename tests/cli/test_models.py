"""The example GPT (zero_kernels.tools.models): activation checkpointing changes memory, not
results."""

import torch

from zero_kernels.tools.models import GPT, GPTConfig


def test_activation_checkpointing_gives_the_same_loss_and_grads():
    cfg = dict(n_layer=3, n_head=4, n_embd=32, block_size=16)
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**cfg))
    ckpt = GPT(GPTConfig(**cfg, activation_checkpointing=True))
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randint(0, 256, (2, 16))
    y = torch.roll(x, -1, dims=1)
    recomputed = []
    for b in ckpt.blocks:  # each block runs twice under checkpointing: forward, then in backward
        # (a pre-hook: torch's recomputation stops once it has what backward needs, so a block's
        # forward hook does not fire then)
        b.register_forward_pre_hook(lambda *a: recomputed.append(1))
    lp, lc = plain(x, y), ckpt(x, y)
    lp.backward()
    lc.backward()
    assert len(recomputed) == 2 * len(ckpt.blocks)
    torch.testing.assert_close(lc, lp, rtol=0, atol=0)
    for (n, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=n)
    with torch.no_grad():  # no recomputation without autograd
        recomputed.clear()
        ckpt(x)
        assert len(recomputed) == len(ckpt.blocks)
