"""RoPE's launch options (``RoPELaunchOptions``): paths the defaults do not take, against the fp32 reference.

The default launch is covered by tests/kernels/test_kernels.py (three-way, fp32 and bf16). Here non-default
launch options are forced through ``rope_launch_options`` at shapes that make their masks bite: 10 tokens with
3 or 4 tokens per program (the last program runs past the end), 6 q heads and 2 k heads with 2 or 4 heads per
tile (the last q tile is half empty with 4), partial rotary dims copied out of place and left alone in place.

fp32 tolerance: the kernel computes ``x1 * c1 - x2 * s1`` in one fp32 pass like the reference; on a GPU the
compiler may fuse a product into an FMA, one rounding of a product fewer, at most 2^-24 * |x| * (|c| + |s|)
~ 4e-7 for the |x| <= 5 drawn here. Through the interpreter the results are bit-identical.
"""

import pytest
import torch

from chunkloss.kernels import apply_rotary_pos_emb, apply_rotary_pos_emb_ref
from chunkloss.kernels.rope import ROPE_LAUNCH, rope_launch_options
from tests.kernels.test_kernels import assert_close3, rope_tables
from tests.tolerances import assert_close_to_ref

BATCH, SEQ, N_Q, N_K = 2, 5, 6, 2  # 10 tokens; grouped-query, 6 is not a power of two
KNOB_SETS = {
    "tokens3_heads2": {"tokens": 3, "block_h": 2},  # 4 programs, the last masks 2 of its 3 tokens
    "tokens4_heads4_evict": {"tokens": 4, "block_h": 4, "num_warps": 2, "evict_first": True},
    "tokens2_warps1": {"tokens": 2, "num_warps": 1},  # 5 programs, none masked
}


def heads(x, n, head_dim, unsqueeze_dim):
    """transformers' ``proj(x).view(B, T, H, D).transpose(1, 2)`` (a non-contiguous view) or (B, T, H, D)."""
    x = x.view(BATCH, SEQ, n, head_dim)
    return x.transpose(1, 2) if unsqueeze_dim == 1 else x


def rope_grads(fn, dtype, head_dim, cos, sin, position_ids, unsqueeze_dim, **kwargs):
    """Outputs and projection gradients of `fn` on fixed inputs; the upstream gradient of q is a dense
    permutation (rotated in place when ``in_place``), that of k a non-dense slice (never overwritten)."""
    torch.manual_seed(0)  # the same inputs for every `fn` and dtype
    q_proj = torch.randn(BATCH, SEQ, N_Q * head_dim).to(dtype).requires_grad_()
    k_proj = torch.randn(BATCH, SEQ, N_K * head_dim).to(dtype).requires_grad_()
    q, k = heads(q_proj * 1, N_Q, head_dim, unsqueeze_dim), heads(k_proj * 1, N_K, head_dim, unsqueeze_dim)
    q_ptr, k_ptr = q.data_ptr(), k.data_ptr()
    qe, ke = fn(q, k, cos.to(dtype), sin.to(dtype), position_ids, unsqueeze_dim, **kwargs)
    if kwargs.get("in_place"):
        assert qe.data_ptr() == q_ptr and ke.data_ptr() == k_ptr
    gq = torch.randn(qe.shape[::-1]).permute(3, 2, 1, 0).to(dtype)
    gk = torch.randn(*ke.shape[:-1], 2 * head_dim)[..., :head_dim].to(dtype)
    dq, dk = torch.autograd.grad((qe, ke), (q_proj, k_proj), (gq, gk))
    return qe, ke, dq, dk


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("head_dim,rot", [(16, 16), (20, 12)], ids=["full", "partial"])
@pytest.mark.parametrize("tables,unsqueeze_dim", [("batched", 1), ("shared", 2), ("position_ids", 2)])
@pytest.mark.parametrize("knobs", list(KNOB_SETS), ids=list(KNOB_SETS))
def test_rope_knobs_fp32(knobs, tables, unsqueeze_dim, head_dim, rot, in_place):
    """Partial (20, 12): 6 halves of 6 dims (a masked 8-wide tile) and 8 pass-through dims."""
    cos, sin, position_ids = rope_tables(BATCH, SEQ, rot, tables)
    ref = rope_grads(apply_rotary_pos_emb_ref, torch.float32, head_dim, cos, sin, position_ids, unsqueeze_dim)
    with rope_launch_options(**KNOB_SETS[knobs]):
        ours = rope_grads(
            apply_rotary_pos_emb,
            torch.float32,
            head_dim,
            cos,
            sin,
            position_ids,
            unsqueeze_dim,
            in_place=in_place,
        )
    for name, a, b in zip(["q_embed", "k_embed", "dq", "dk"], ours, ref):
        assert_close_to_ref(a, b, name=name)


@pytest.mark.parametrize("in_place", [False, True])
def test_rope_knobs_bf16(in_place):
    """Three-way in bf16 (as test_kernels.test_rope) with tokens and head tiles that do not divide."""
    cos, sin, _ = rope_tables(BATCH, SEQ, 12, "batched")
    ref = rope_grads(apply_rotary_pos_emb_ref, torch.float32, 20, cos, sin, None, 1)
    tch = rope_grads(apply_rotary_pos_emb_ref, torch.bfloat16, 20, cos, sin, None, 1)
    with rope_launch_options(tokens=3, block_h=4):
        ours = rope_grads(apply_rotary_pos_emb, torch.bfloat16, 20, cos, sin, None, 1, in_place=in_place)
    for name, a, b, c in zip(["q_embed", "k_embed", "dq", "dk"], ours, tch, ref):
        assert_close3(a, b, c, torch.bfloat16, name)


def test_rope_table_halves_may_differ():
    """Tables whose halves differ (c1 != c2, s1 != s2; transformers' happen to be equal): every formula of
    the derivation above the kernel is exercised with distinct factors."""
    cos, sin = torch.randn(BATCH, SEQ, 16), torch.randn(BATCH, SEQ, 16)
    ref = rope_grads(apply_rotary_pos_emb_ref, torch.float32, 16, cos, sin, None, 1)
    ours = rope_grads(apply_rotary_pos_emb, torch.float32, 16, cos, sin, None, 1)
    for name, a, b in zip(["q_embed", "k_embed", "dq", "dk"], ours, ref):
        assert_close_to_ref(a, b, name=name)


@pytest.mark.parametrize("frozen", ["q", "k"])
def test_rope_gradient_of_one_input_only(frozen):
    """The frozen input's gradient is skipped in the kernel (zero heads); the other's is still right."""
    cos, sin, _ = rope_tables(BATCH, SEQ, 8, "batched")
    q = torch.randn(BATCH, N_Q, SEQ, 8, requires_grad=frozen != "q")
    k = torch.randn(BATCH, N_K, SEQ, 8, requires_grad=frozen != "k")
    trained = k if frozen == "q" else q
    gq, gk = torch.randn(BATCH, N_Q, SEQ, 8), torch.randn(BATCH, N_K, SEQ, 8)

    def loss(fn):
        qe, ke = fn(q, k, cos, sin)
        return (qe * gq).sum() + (ke * gk).sum()

    (got,) = torch.autograd.grad(loss(apply_rotary_pos_emb), (trained,))
    (want,) = torch.autograd.grad(loss(apply_rotary_pos_emb_ref), (trained,))
    assert_close_to_ref(got, want)


def test_rope_unused_output_gets_zero_gradient():
    """k's output unused: k's gradient is an explicit zero tensor, q's is right."""
    cos, sin, _ = rope_tables(BATCH, SEQ, 8, "batched")
    q = torch.randn(BATCH, N_Q, SEQ, 8, requires_grad=True)
    k = torch.randn(BATCH, N_K, SEQ, 8, requires_grad=True)
    gq = torch.randn(BATCH, N_Q, SEQ, 8)
    dq, dk = torch.autograd.grad(apply_rotary_pos_emb(q, k, cos, sin)[0], (q, k), gq)
    (dq_ref,) = torch.autograd.grad(apply_rotary_pos_emb_ref(q, k, cos, sin)[0], (q,), gq)
    assert_close_to_ref(dq, dq_ref)
    assert dk.shape == k.shape and not dk.any()


def test_rope_knobs_context_restores():
    cpu = torch.device("cpu")
    before = ROPE_LAUNCH.get(cpu)
    assert before is ROPE_LAUNCH.default
    with pytest.raises(RuntimeError), rope_launch_options(tokens=5) as knobs:
        assert ROPE_LAUNCH.get(cpu) is knobs and knobs.tokens == 5 and knobs.num_warps == before.num_warps
        raise RuntimeError  # restored on the way out of an error too
    assert ROPE_LAUNCH.get(cpu) is before


@pytest.mark.gpu
@pytest.mark.parametrize(
    "knobs",
    [{}, {"tokens": 4, "num_warps": 8, "block_h": 8, "evict_first": True}, {"tokens": 8, "num_warps": 2}],
    ids=["defaults", "t4_w8_h8_ev", "t8_w2"],
)
def test_rope_knobs_llama_shape_gpu(knobs):
    """Compiled kernels at 32 / 8 heads x 128 with 3 x 1001 tokens (4 and 8 per program do not divide it),
    bf16, in place, q and k as (B, T, H, D) leaves handed over as (B, H, T, D) views like bench_kernels."""
    batch, seq, n_q, n_k, head_dim = 3, 1001, 32, 8, 128
    cos, sin, _ = rope_tables(batch, seq, head_dim, "batched")
    q_master = torch.randn(batch, seq, n_q, head_dim, device="cuda")
    k_master = torch.randn(batch, seq, n_k, head_dim, device="cuda")
    gq, gk = torch.randn_like(q_master).transpose(1, 2), torch.randn_like(k_master).transpose(1, 2)
    outs = []
    for dt, fn in (
        (torch.float32, apply_rotary_pos_emb_ref),
        (torch.bfloat16, apply_rotary_pos_emb_ref),
        (torch.bfloat16, apply_rotary_pos_emb),
    ):
        q, k = q_master.to(dt).requires_grad_(), k_master.to(dt).requires_grad_()
        kwargs = {"in_place": True} if fn is apply_rotary_pos_emb else {}
        with rope_launch_options(**knobs):
            qe, ke = fn(
                (q * 1).transpose(1, 2),
                (k * 1).transpose(1, 2),
                cos.cuda().to(dt),
                sin.cuda().to(dt),
                **kwargs,
            )
            dq, dk = torch.autograd.grad((qe, ke), (q, k), (gq.to(dt), gk.to(dt)))
        outs.append((qe, ke, dq, dk))
    ref, tch, ours = outs
    for i, name in enumerate(["q_embed", "k_embed", "dq", "dk"]):
        assert_close3(ours[i], tch[i], ref[i], torch.bfloat16, name)
