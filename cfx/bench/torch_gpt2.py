"""The same GPT-2 math as ``cfx.models.GPT2``, written as a plain eager ``torch.nn.Module``.

This is the baseline the overhead benchmark runs side by side with cfx (nanoGPT's habits:
pre-norm blocks, separate q/k/v projections, SDPA, tied embeddings).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C: int, H: int, eps: float):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C, eps=eps), nn.LayerNorm(C, eps=eps)
        self.q, self.k, self.v, self.o = (nn.Linear(C, C) for _ in range(4))
        self.fc, self.proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        h = self.ln_1(x)
        q, k, v = (lin(h).view(B, T, self.H, C // self.H).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class TorchGPT2(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = config
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.n_positions, c.n_embd)
        self.blocks = nn.ModuleList(Block(c.n_embd, c.n_head, c.layer_norm_eps) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, eps=c.layer_norm_eps)

    def forward(self, tokens, targets):
        T = tokens.shape[1]
        x = self.wte(tokens) + self.wpe.weight[:T]  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def load_cfx(self, params) -> "TorchGPT2":
        """Copy cfx GPT-2 params in (cfx Linear weights are (in, out); nn.Linear's are (out, in))."""
        def lin(m, p):
            m.weight.copy_(p["w"].T)
            m.bias.copy_(p["b"])

        def norm(m, p):
            m.weight.copy_(p["scale"])
            m.bias.copy_(p["bias"])
        self.wte.weight.copy_(params["wte"]["w"])
        self.wpe.weight.copy_(params["wpe"]["w"])
        for m, p in zip(self.blocks, params["blocks"]):
            norm(m.ln_1, p["norm1"])
            norm(m.ln_2, p["norm2"])
            for name in "qkvo":
                lin(getattr(m, name), p["attn"][name])
            lin(m.fc, p["mlp"]["fc"])
            lin(m.proj, p["mlp"]["proj"])
        norm(self.ln_f, params["ln_f"])
        return self


def autocast_step(forward, opt: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One training step of a Module's ``forward(tokens, targets) -> loss`` under bf16 autocast (the
    baseline's mixed precision): backward, ``opt.step()``, gradients dropped; the loss, detached."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
        loss = forward(tokens, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()
