"""What the decoders share (``cfx._src.models.common.DecoderLM``): the head's loss fused with its matmul
(``head_loss(..., fused=True)``, what CUDA runs) equals the unfused loss in value and in every
gradient, for a tied head (GPT-2), an untied one (Llama) and one behind a projection (OPT). A preset's
name may carry field overrides (``"tiny,n_layer=3"``: how ``python -m cfx.train --preset`` sets them)."""
from __future__ import annotations

import pytest
import torch

import cfx

V = 96


def models():
    return {
        "gpt2": cfx.models.gpt2("tiny", n_layer=1, vocab_size=V, n_positions=32),
        "llama": cfx.models.llama("tiny", n_layer=1, vocab_size=V, max_position_embeddings=32,
                                  tie_embeddings=False),
        "opt": cfx.models.opt("tiny", n_layer=1, vocab_size=V, max_position_embeddings=32,
                              word_embed_proj_dim=16),
    }


@pytest.mark.parametrize("name", ["gpt2", "llama", "opt"])
def test_fused_head_loss_equals_the_unfused_loss_and_gradients(name):
    model = models()[name]
    params = cfx.tree.map(lambda x: x.double(), model.init(cfx.random.key(0)))
    tokens = cfx.random.randint(cfx.random.key(1), (2, 12), 0, V)
    targets = cfx.random.randint(cfx.random.key(2), (2, 12), 0, V)
    targets[0, :3] = -100  # ignored positions

    def fused(p):
        return model.head_loss(p, model.hidden(p, tokens), targets, fused=True)

    def textbook(p):  # in fp64 (the unfused loss computes in fp32)
        logits = model.logits(p, model.hidden(p, tokens))  # (B, T, V)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    want, want_grads = cfx.value_and_grad(textbook)(params)
    got, got_grads = cfx.value_and_grad(fused)(params)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grads, want_grads, rtol=1e-10, atol=1e-12)
    unfused = model.head_loss(params, model.hidden(params, tokens), targets, fused=False)  # the CPU's default
    torch.testing.assert_close(model.loss(params, tokens, targets), unfused)
    torch.testing.assert_close(unfused.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_on_cuda_the_id_checks_do_not_make_the_host_wait():
    """On CUDA the token and target checks are device-side assertions: a train step's loss reads
    nothing back (the launches run ahead of the kernels), and a bad id still stops the run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Syncs(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += str(func) in ("aten._local_scalar_dense.default", "aten.is_nonzero.default")
            return func(*args, **(kwargs or {}))

    model = cfx.models.gpt2("tiny", n_layer=1, vocab_size=64, n_embd=32, n_head=4, n_positions=16)
    params = cfx.tree.map(lambda x: x.cuda(), model.init(cfx.random.key(0)))
    tokens = cfx.random.randint(cfx.random.key(1), (2, 17), 0, 64).cuda()
    with Syncs() as syncs:
        loss, _ = cfx.value_and_grad(model.loss)(params, tokens[:, :-1], tokens[:, 1:])
    assert syncs.n == 0 and torch.isfinite(loss).item()
    # (a failed device-side assertion poisons the CUDA context, so the bad id runs in a subprocess)
    import subprocess
    import sys
    code = ("import torch, cfx; m = cfx.models.gpt2('tiny', n_layer=1, vocab_size=64, n_embd=32, n_head=4, "
            "n_positions=16); p = cfx.tree.map(lambda x: x.cuda(), m.init(cfx.random.key(0))); "
            "t = torch.full((1, 8), 70).cuda(); m.apply(p, t); torch.cuda.synchronize()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "assert" in proc.stderr.lower()


def test_a_preset_name_carries_field_overrides():
    config = cfx.models.mixtral("tiny,n_layer=3,router_aux_group_size=16,rope_theta=1e6", vocab_size=V).config
    assert (config.n_layer, config.router_aux_group_size, config.rope_theta, config.n_experts) == (3, 16, 1e6, 4)
    assert cfx.models.llama("tiny,n_layer=3", n_layer=1).config.n_layer == 1  # keyword overrides win
    with pytest.raises(ValueError, match="'n_layer' in 'tiny,n_layer' is not field=value"):
        cfx.models.llama("tiny,n_layer")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['layers'\]"):
        cfx.models.opt("tiny,layers=3")
