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
