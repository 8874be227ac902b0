"""chunkloss.heads: Medusa heads and DeepSeek-V3 multi-token prediction modules, and training them through
FusedLinearMultiTokenLoss against the same loss on materialised logits."""

import pytest
import torch
import torch.nn.functional as F

from chunkloss import FusedLinearMultiTokenLoss
from chunkloss.data import tiny_model, tiny_tokenizer
from chunkloss.heads import MedusaHeads, MultiTokenPrediction, ResBlock, add_medusa_heads

B, T, H, V = 2, 11, 16, 37


def test_resblock_starts_as_identity_plus_silu_of_bias():
    block = ResBlock(H)
    x = torch.randn(B, T, H)
    assert not block.linear.weight.any()
    torch.testing.assert_close(block(x), x + F.silu(block.linear.bias))


def test_medusa_heads_copy_or_share_the_base_head():
    base = torch.randn(V, H)
    own = MedusaHeads(H, V, num_heads=3, num_layers=2, base_weight=base)
    assert len(own.blocks) == 3 and len(own.blocks[0]) == 2
    assert all(torch.equal(w, base) for w in own.weights(base))
    assert own.lm_heads[0].weight.data_ptr() != base.data_ptr()
    shared = MedusaHeads(H, V, num_heads=3, share_lm_head=True)
    assert shared.lm_heads is None and shared.weights(base) is base
    hidden = torch.randn(B, T, H)
    assert own.logits(hidden).shape == (3, B, T, V)
    torch.testing.assert_close(shared.logits(hidden, base)[1], shared.blocks[1](hidden) @ base.t())


@pytest.mark.parametrize("kw", [{"num_heads": 0}, {"num_heads": 2, "num_layers": 0}, {"num_heads": 1.5}])
def test_medusa_heads_bad_sizes(kw):
    with pytest.raises(ValueError, match="must be an int ≥ 1"):
        MedusaHeads(H, V, **kw)


def test_add_medusa_heads_to_a_causal_lm():
    model = tiny_model(tiny_tokenizer(), "qwen3", hidden_size=32, num_layers=1)
    heads = add_medusa_heads(model, num_heads=2)
    assert model.medusa_heads is heads and model.config.medusa_num_heads == 2
    assert torch.equal(heads.lm_heads[1].weight, model.lm_head.weight)
    assert any(n.startswith("medusa_heads.") for n in model.state_dict())
    assert add_medusa_heads(model) is heads  # the shape recorded in the config
    with pytest.raises(ValueError, match="already has Medusa heads"):
        add_medusa_heads(model, num_heads=4)


def test_mtp_is_causal():
    """Depth k at position i sees the embeddings of tokens up to i + k only."""
    mtp = MultiTokenPrediction(H, depth=3, num_attention_heads=2)
    hidden, embeds = torch.randn(B, T, H), torch.randn(B, T, H)
    outs = mtp(hidden, embeds)
    assert len(outs) == 3 and all(o.shape == (B, T, H) for o in outs)
    j = 8
    changed = embeds.clone()
    changed[:, j] += 1.0
    for k, (a, b) in enumerate(zip(outs, mtp(hidden, changed)), 1):
        torch.testing.assert_close(a[:, : j - k], b[:, : j - k])
        assert not torch.allclose(a[:, j - k], b[:, j - k])


def test_mtp_trains_through_the_multi_token_loss():
    """Main head plus D depths through one shared head: loss and every gradient as K materialised CEs."""
    torch.manual_seed(0)
    depth, lam = 2, 0.3
    mtp = MultiTokenPrediction(H, depth=depth, num_attention_heads=2).double()
    hidden = torch.randn(B, T, H, dtype=torch.float64, requires_grad=True)
    embeds = torch.randn(B, T, H, dtype=torch.float64)
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (B, T))
    labels[0, 3] = -100
    head_weights = (1.0, *(lam / depth,) * depth)

    def grads(loss):
        params = [hidden, weight, *mtp.parameters()]
        return torch.autograd.grad(loss, params)

    loss_fn = FusedLinearMultiTokenLoss(head_weights, chunk_size=8, compile=False)
    ours = loss_fn([hidden, *mtp(hidden, embeds)], weight, labels)
    ref = 0.0
    for k, h in enumerate([hidden, *mtp(hidden, embeds)]):
        z = h[:, : T - k] @ weight.t()
        ref = ref + head_weights[k] * F.cross_entropy(z.flatten(0, 1), labels[:, k:].flatten())
    torch.testing.assert_close(ours.double(), ref)
    for g, r in zip(grads(ours), grads(ref)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_mtp_bad_inputs():
    with pytest.raises(ValueError, match="depth must be an int ≥ 1"):
        MultiTokenPrediction(H, depth=0)
    with pytest.raises(ValueError, match="embeds shape"):
        MultiTokenPrediction(H, depth=1, num_attention_heads=2)(
            torch.randn(B, T, H), torch.randn(B, T - 1, H)
        )
