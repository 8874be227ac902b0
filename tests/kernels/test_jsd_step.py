"""The JSD chunk step kernel (per-row divergence, hard loss and entropy; the student's dL/dlogits written
over its logits) against its fp32 reference ``jsd_step_ref`` (plain PyTorch autograd of the same per-row
terms).

On CPU the kernel runs through TRITON_INTERPRET=1 at small shapes with a column block small enough that every
pass crosses several blocks, the last one masked; on a GPU the same grid runs there and the real vocabulary is
checked and timed in the ``gpu`` test.

Kernel and reference compute in fp32 from the same logits and round the gradient once; they differ in the
order of the sums and in exp/log. Measured over this grid on CPU: per-row terms ≤ 6.7e-6 (fp32) and 9.5e-6
(bf16 inputs) absolute on values up to ~10, fp32 gradients ≤ 1.7e-6; 16-bit gradients one unit in the last
place (the interpreter truncates fp32 -> bf16 where torch rounds to nearest).
"""

import itertools

import pytest
import torch

import chunkloss.kernels.jsd as kj
from tests.tolerances import assert_close_to_ref

CAPS = dict(student_logit_scale=1.3, student_softcap=4.0, teacher_logit_scale=0.8, teacher_softcap=5.0)
# (β, τ, hard weight, head transforms): both endpoints and the mixture, each with and without temperature,
# hard loss and transforms, in a covering set of twelve.
CASES = [
    (beta, tau, hard, caps)
    for (beta, tau, hard, caps) in itertools.product(
        [0.0, 0.1, 0.5, 1.0], [1.0, 0.7], [0.0, 0.4], [False, True]
    )
    if (tau == 1.0) == (hard == 0.0) or caps
]


def _ulp(x: torch.Tensor) -> torch.Tensor:
    mant = {torch.bfloat16: 7, torch.float16: 10}[x.dtype]
    return torch.ldexp(torch.ones_like(x.float()), torch.frexp(x.float())[1] - 1 - mant)


@pytest.mark.parametrize("beta, tau, hard, caps", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("c, v, block", [(3, 2, 16), (1, 37, 16), (5, 130, 64)])  # V=2: one 2-wide block
def test_jsd_step(c, v, block, dtype, beta, tau, hard, caps, monkeypatch):
    monkeypatch.setattr(kj, "BLOCK_V", block)
    kw = dict(beta=beta, temperature=tau, weight_hard_loss=hard, weight_soft_loss=0.9)
    kw |= CAPS if caps else {}
    zs, zt = (3 * torch.randn(c, v)).to(dtype), (3 * torch.randn(c, v)).to(dtype)
    zs[0, :3] = 20.0  # a large early logit: the running max moves once, then not again
    y, norm = torch.randint(0, v, (c,)), torch.tensor(3.0)
    ours, ref = zs.clone(), zs.clone()
    rows, ref_rows = kj.jsd_step(ours, zt, y, norm, **kw), kj.jsd_step_ref(ref, zt, y, norm, **kw)
    assert set(rows) == set(ref_rows) == ({"soft", "entropy", "hard"} if hard else {"soft", "entropy"})
    for k in ref_rows:
        assert_close_to_ref(rows[k], ref_rows[k], name=k)
    assert ours.dtype == dtype
    if dtype == torch.float32:  # entries are differences of probabilities over the normaliser: at most 1/norm
        assert_close_to_ref(ours, ref, name="dL/dlogits", scale=1 / float(norm))
    else:
        assert ((ours.float() - ref.float()).abs() <= _ulp(ref) + 1e-6).all()


def test_jsd_step_bad_input():
    z, y, n = torch.randn(4, 50), torch.randint(0, 50, (4,)), torch.tensor(1.0)
    with pytest.raises(ValueError, match="teacher_logits"):
        kj.jsd_step(z, z[:, :40], y, n)
    with pytest.raises(TypeError, match="normaliser"):
        kj.jsd_step(z, z, y, n.double())
    with pytest.raises(ValueError, match="labels"):
        kj.jsd_step(z, z, y[:2], n)
    with pytest.raises(TypeError, match="logits must be"):
        kj.jsd_step(z.double(), z, y, n)
    for bad, match in [
        (dict(beta=1.5), "beta"),
        (dict(temperature=0.0), "temperature"),
        (dict(teacher_softcap=-1.0), "teacher_softcap"),
    ]:
        with pytest.raises(ValueError, match=match):
            kj.jsd_step(z, z, y, n, **bad)
        with pytest.raises(ValueError, match=match):
            kj.jsd_step_ref(z, z, y, n, **bad)
    assert set(kj.jsd_step(z[:0], z[:0], y[:0], n)) == {"soft", "entropy"}


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_step_real_vocab(beta):
    """A 1280-row chunk of Llama-3's vocabulary in bf16 (the compiled step's automatic JSD chunk at H=4096;
    the kernel's is 2048 rows): values against the reference, and the kernel's time beside the compiled step
    it replaces (printed)."""
    import triton

    from chunkloss.losses.common import LabelRows, Normalisers
    from chunkloss.losses.jsd import JSDOptions, jsd_chunk

    c, v = 1280, 128256
    zs = (3 * torch.randn(c, v, device="cuda")).bfloat16()
    zt = (3 * torch.randn(c, v, device="cuda")).bfloat16()
    y, norm = torch.randint(0, v, (c,), device="cuda"), torch.tensor(float(c), device="cuda")
    opts, kw = JSDOptions(beta=beta, weight_hard_loss=0.1), dict(beta=beta, weight_hard_loss=0.1)
    ours, ref = zs.clone(), zs.clone()
    rows, ref_rows = kj.jsd_step(ours, zt, y, norm, **kw), kj.jsd_step_ref(ref, zt, y, norm, **kw)
    for k in ref_rows:
        assert_close_to_ref(rows[k], ref_rows[k], name=k)
    assert ((ours.float() - ref.float()).abs() <= _ulp(ref) + 1e-9).all()

    def compiled_step(z):
        g, _ = torch.func.grad_and_value(
            lambda x: jsd_chunk(x, [zt], LabelRows(y), Normalisers(norm, n_valid=norm), opts),
            has_aux=True,
        )(z)
        z.copy_(g)

    compiled = torch.compile(compiled_step)
    t_kernel = triton.testing.do_bench(lambda: kj.jsd_step(zs, zt, y, norm, **kw))
    t_compiled = triton.testing.do_bench(lambda: compiled(zs))
    print(
        f"jsd_step 1280x128256 bf16 beta={beta}: kernel {t_kernel:.3f} ms, compiled step {t_compiled:.3f} ms"
    )
