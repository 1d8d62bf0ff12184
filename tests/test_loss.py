"""The clipped, truncated policy loss."""

import torch

from trainer.loss import policy_loss


def _run(new, old, adv, **kw):
    new = torch.tensor([new], requires_grad=True)
    mask = torch.ones_like(new, dtype=torch.bool)
    args = dict(clip_low=0.2, clip_high=0.2, is_cap=3.0)
    args.update(kw)
    parts = policy_loss(new, torch.tensor([old]), torch.tensor([adv]), mask, **args)
    parts.loss.backward()
    return parts, new.grad


def test_on_policy_gradient_is_minus_advantage():
    parts, grad = _run([0.0, -1.0], [0.0, -1.0], [1.0, -2.0])
    torch.testing.assert_close(parts.loss, torch.tensor(1.0))  # -(1*1) - (1*-2)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 2.0]]))
    assert parts.clipped == 0 and parts.tokens == 2


def test_positive_advantage_is_clipped_above():
    ratio_hi = float(torch.log(torch.tensor(1.5)))
    parts, grad = _run([ratio_hi], [0.0], [1.0])
    torch.testing.assert_close(parts.loss, torch.tensor(-1.2))
    assert grad.abs().sum() == 0 and parts.clipped == 1


def test_negative_advantage_is_truncated_by_dual_clip():
    big = float(torch.log(torch.tensor(10.0)))
    parts, grad = _run([big], [0.0], [-1.0], is_cap=3.0)
    torch.testing.assert_close(parts.loss, torch.tensor(3.0))  # bounded by is_cap * |A|
    assert grad.abs().sum() == 0


def test_mask_excludes_padding():
    new = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    parts = policy_loss(new, torch.zeros(1, 3), torch.ones(1, 3), mask, 0.2, 0.2, 3.0)
    parts.loss.backward()
    assert parts.tokens == 2 and new.grad[0, 2] == 0


def test_kl_to_reference_pulls_towards_it():
    new = torch.tensor([[0.0]], requires_grad=True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    parts = policy_loss(
        new,
        torch.zeros(1, 1),
        torch.zeros(1, 1),
        mask,
        0.2,
        0.2,
        3.0,
        ref_lp=torch.tensor([[-1.0]]),
        kl_coef=0.5,
    )
    parts.loss.backward()
    assert parts.kl_sum > 0
    assert new.grad[0, 0] > 0  # descending lowers log-prob toward the reference
