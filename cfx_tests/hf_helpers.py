"""Helpers shared by the Hugging Face parity tests."""
import torch


def roughen(hf_model, norm_suffixes, seed=0):
    """Move every HF weight well off its init so a wrong eps, bias, RoPE or layout shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            base = 1.0 if name.endswith(tuple(norm_suffixes)) else 0.0
            p.copy_(base + 0.15 * torch.randn(p.shape, generator=g))
    return hf_model


def random_tokens(B, T, V, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def shifted_targets(tok):
    """Next-token targets with the last position ignored (-100)."""
    return torch.cat([tok[:, 1:], torch.full_like(tok[:, :1], -100)], dim=1)


# Bounds of the fp64 parity tests where a side rounds to fp32 by design: each at least 10x the worst measured
# over intra-op threads 1, 2 and 4 and both xdist layouts (-n auto, -p no:xdist), and above that rounding.
# transformers' eager attention takes its softmax in fp32 even in an fp64 model (``softmax(...,
# dtype=torch.float32)``: CLIP, Llama, OPT, Mixtral), probabilities rounded by 2**-24: measured 1.4e-6 on
# Llama's logits (of order 10, 2 layers); x15
FP32_SOFTMAX = dict(rtol=0, atol=2e-5)
# transformers' causal-LM loss takes its softmax in fp32 (loss_utils: ``logits.float()``) where cfx's keeps an
# fp64 model's loss in fp64 (cfx_kernels' reference: at least fp32): their loss is an fp32 number, 2**-24 (6e-8)
# apart from fp64's: measured 9.6e-8 relative (BERT's fp32 loss against its fp64 one, when cfx's was fp32); x10
FP32_LOSS = dict(rtol=1e-6, atol=0)
# ... and d loss / d logits carries that rounding into every gradient (against Mixtral's fp32 loss): measured
# 4.6e-8 (BERT's, gradients of order 0.1-1, when cfx's loss was fp32); x11
FP32_LOSS_GRADS = dict(rtol=0, atol=5e-7)
