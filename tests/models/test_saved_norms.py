"""chunkloss.models.saved_norms: saved norm outputs packed as recipes, the rest through the hooks outside."""

import torch

from chunkloss.models import saved_norms


def _norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _run(x, w, a, b, *, recompute: bool, mutate: bool = False):
    """y = norm(x); loss = Σ (y·a)ᵀ-ish products that save y (and a view of it); gradients of x, w, a, b."""
    x, w, a, b = (t.detach().clone().requires_grad_() for t in (x, w, a, b))
    calls = []

    def again():
        calls.append(1)
        return _norm(x, w)

    with saved_norms.SavedNorms() if recompute else torch.enable_grad():
        y = _norm(x, w)
        saved_norms.offer(y, again)
        if mutate:
            y = y.mul_(2.0)  # changed after the offer: must be kept as it is, not recomputed
        z = (y @ a).sum() + (y[:, 1:] @ b).sum()  # y and a strided view of it are saved
    z.backward()
    return [t.grad for t in (x, w, a, b)], len(calls)


def test_recipe_gives_the_same_gradients_and_runs_once():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 8, generator=g), torch.randn(8, generator=g)
    a, b = torch.randn(8, 3, generator=g), torch.randn(7, 3, generator=g)
    ref, _ = _run(x, w, a, b, recompute=False)
    got, calls = _run(x, w, a, b, recompute=True)
    assert calls == 1  # one recomputation shared by both consumers
    for r, t in zip(ref, got, strict=True):
        assert torch.equal(r, t)


def test_output_changed_in_place_is_kept_not_recomputed():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 8, generator=g), torch.randn(8, generator=g)
    a, b = torch.randn(8, 2, generator=g), torch.randn(7, 2, generator=g)
    ref, _ = _run(x, w, a, b, recompute=False, mutate=True)
    got, calls = _run(x, w, a, b, recompute=True, mutate=True)
    assert calls == 0
    for r, t in zip(ref, got, strict=True):
        assert torch.equal(r, t)


def test_hooks_outside_still_see_every_other_tensor():
    seen, unpacked = [], []

    def pack(t):
        seen.append(t.shape)
        return t

    def unpack(t):
        unpacked.append(t.shape)
        return t

    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    a = torch.randn(4, 2, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), saved_norms.SavedNorms():
        y = _norm(x, w)
        saved_norms.offer(y, lambda: _norm(x, w))
        (y @ a).sum().backward()
    assert (3, 4) in seen and (4, 2) in seen  # x (saved by pow) and a reach the outer hooks ...
    assert len(unpacked) == len(seen)  # ... and come back through them
    assert torch.equal(a.grad, _norm(x, w).detach().t() @ torch.ones(3, 2))
