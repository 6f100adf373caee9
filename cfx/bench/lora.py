"""``python -m cfx.bench lora``: what LoRA trains and holds, against full fine-tuning, on CPU.

GPT-2 (toy widths under ``--smoke``, 4 x 256 under ``--quick``, the ``small`` widths otherwise), fp32,
adapters of rank ``r`` on every attention and MLP Linear (q, k, v apart: the textbook count), AdamW:

* ``trainable_bytes_vs_formula``: the adapters and their AdamW state (``mu``, ``nu`` and the step
  count) over ``r (in + out)`` per adapted weight x 4 bytes x 3 (target 1.00);
* ``peak_memory_int8_lora_vs_full_ft``: one training step's peak (the params and optimizer state it
  holds, booked with ``cfx.memory.watch``, plus every op output of forward, backward and the update,
  ``track_ops``) with an int8 base (``cfx.quant``, embeddings kept in fp32) and LoRA, over full
  fine-tuning's. The int8 matmul (its plain-PyTorch reference on CPU, the Triton kernel on CUDA)
  keeps the int8 weight for backward and converts it again there, so no floating copy of a frozen
  weight outlives its matmul; ``state_bytes_int8_lora_vs_full_ft`` is the held state alone (params,
  trainable gradients, AdamW state);
* step time (forward, backward, AdamW) of LoRA over full fine-tuning, on an fp32 and an int8 base.
"""
from __future__ import annotations

import torch

import cfx
from cfx.bench.common import Row, interleaved_medians, report, size_of

SIZES = {  # model overrides, batch, sequence, rank, timing rounds
    "smoke": (dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16), 2, 8, 4, 1),
    "quick": (dict(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=64), 4, 64, 8, 3),
    "full": (dict(n_layer=12, n_embd=768, n_head=12), 2, 128, 16, 3),
}


def _setup(size: str):
    overrides, B, T, r, rounds = SIZES[size]
    model = cfx.models.gpt2("small" if size == "full" else "tiny", **overrides)
    params = model.init(cfx.random.key(0))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    config = cfx.lora.LoraConfig(r=r, alpha=2 * r, targets=("attn", "mlp"))
    return model, params, tokens, targets, config, rounds


def _steps(model, params, tokens, targets, config):
    """(name -> (train step, the state it trains)): full fine-tuning, LoRA on the fp32 base, on int8."""
    tx = cfx.optim.adamw(1e-4)
    int8 = cfx.quant.quantize(params, "int8", axes=model.axes(), min_size=0)

    def full(p, s):
        _, grads = cfx.value_and_grad(model.loss)(p, tokens, targets)
        updates, s = tx.update(grads, s, p)
        return cfx.optim.apply_updates(p, updates), s

    def lora(base):
        def step(ad, s):
            _, grads = cfx.value_and_grad(lambda a: model.loss(cfx.lora.attach(base, a, config), tokens, targets))(ad)
            updates, s = tx.update(grads, s, ad)
            return cfx.optim.apply_updates(ad, updates), s
        return step

    adapters = cfx.lora.init(model, config, cfx.random.key(1))
    return {"full": (full, params, (params,)), "lora": (lora(params), adapters, (params,)),
            "lora_int8": (lora(int8), adapters, (int8,))}, tx


def _peak(step, trained, held, tx) -> tuple[int, int]:
    """(peak bytes of one step, bytes held before it): the frozen base, the trained tree and its
    optimizer state booked as held, every op output of the step on top."""
    state = tx.init(trained)
    resident = [x for x in cfx.tree.leaves((held, trained, state)) if isinstance(x, torch.Tensor)]
    with cfx.memory.track() as mem:
        for x in resident:
            cfx.memory.watch(x, tier="device", kind="state")
        before = mem.live("device")
        with mem.track_ops(tier="device"):
            out = step(trained, state)
        del out
    return mem.peak("device"), before


def _formula(model, config) -> int:
    """4 bytes x 3 (the adapter, AdamW's mu and nu) x r (in + out) per adapted weight."""
    shapes = cfx.eval_shape(model.init, cfx.random.key(0))
    flat = dict(cfx.tree.flatten_with_path(shapes)[0])
    n = 0
    for path in cfx.tree.leaf_paths(cfx.lora.init(model, config, cfx.random.key(0))):
        if path.endswith(".A"):
            d_in, d_out = flat[path[:-2] + ".w"].shape
            n += config.r * (d_in + d_out)
    return 4 * 3 * n


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    model, params, tokens, targets, config, rounds = _setup(size)
    steps, tx = _steps(model, params, tokens, targets, config)
    adapters = steps["lora"][1]
    c = model.config
    rows = [Row(f"GPT-2 {c.n_layer}x{c.n_embd}, vocab {c.vocab_size}, r={config.r} on attn + mlp: params", cfx.tree.size(params),
                "params"),
            Row("LoRA: trained params / base params", cfx.tree.size(adapters) / cfx.tree.size(params), "x", "info")]
    trained = cfx.tree.nbytes(adapters) + cfx.tree.nbytes(tx.init(adapters))
    ratio = trained / _formula(model, config)
    rows.append(Row("trainable_bytes_vs_formula", ratio, "x", "1.00 (r (in + out) x 4 B x 3 per target)",
                    abs(ratio - 1) < 0.01))
    peaks = {name: _peak(step, tr, held, tx) for name, (step, tr, held) in steps.items()}
    held = {name: cfx.tree.nbytes(h) + 3 * cfx.tree.nbytes(tr) for name, (_, tr, h) in steps.items()}  # + grads, mu, nu
    for name in ("full", "lora_int8"):
        rows.append(Row(f"{name}: peak of one training step (held state + op outputs)", peaks[name][0] / 2**20, "MiB"))
    mem = peaks["lora_int8"][0] / peaks["full"][0]
    rows.append(Row("peak_memory_int8_lora_vs_full_ft", mem, "x", "< 0.5", mem < 0.5))
    state = held["lora_int8"] / held["full"]
    rows.append(Row("state_bytes_int8_lora_vs_full_ft", state, "x", "< 0.3 (int8 weights, fp32 embeddings)",
                    state < 0.3))
    fns = [lambda s=step, t=tr, o=tx.init(tr): s(t, o) for step, tr, _ in steps.values()]
    times = dict(zip(steps, interleaved_medians(fns, rounds=rounds)))
    rows.append(Row("full fine-tuning: step time", times["full"], "s"))
    rows.append(Row("step_time_lora_vs_full_ft (fp32 base)", times["lora"] / times["full"], "x",
                    "< 1 (no weight gradients, AdamW over the adapters)", times["lora"] < times["full"]))
    rows.append(Row("step_time_int8_lora_vs_full_ft", times["lora_int8"] / times["full"], "x",
                    "info (CPU: the reference int8 matmul converts each weight per call)"))
    return report("lora", rows, json_path)


def peft_rows(device: str, *, smoke: bool = False) -> list[Row]:
    """``lora_step_vs_peft_gpu``: one LoRA training step (forward, backward, AdamW over the adapters) of cfx
    against peft on the same GPT-2 small as an ``nn.Module`` (``TorchGPT2``: the same q, k, v, o, fc, proj
    Linears, so both adapt the same weights), r = 16, bf16 base weights, fp32 adapters, bf16 compute
    (``cfx.amp.policy("bf16")``; ``torch.autocast`` for peft), B8 x 512, steps interleaved."""
    import peft

    from cfx.bench.torch_gpt2 import TorchGPT2, autocast_step

    kw, B, T, rounds = (SIZES["smoke"][0], 2, 8, 1) if smoke else ({}, 8, 512, 10)
    tag = "" if device == "cuda" else " [cpu smoke]"
    model = cfx.models.gpt2("small", **kw)
    params = model.init(cfx.random.key(0))
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, model.config.vocab_size, (B, T), generator=g).to(device) for _ in range(2))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    config = cfx.lora.LoraConfig(r=16, alpha=32, targets=("attn", "mlp"))
    base = cfx.tree.map(lambda x: x.to(device, torch.bfloat16), params)
    policy = cfx.amp.policy("bf16")
    tx = cfx.optim.adamw(1e-4)

    def step(ad, s):
        _, grads = cfx.value_and_grad(
            lambda a: model.loss(policy.cast_to_compute(cfx.lora.attach(base, a, config)), tokens, targets))(ad)
        updates, s = tx.update(grads, s, ad)
        return cfx.optim.apply_updates(ad, updates), s

    adapters = cfx.tree.map(lambda x: x.to(device), cfx.lora.init(model, config, cfx.random.key(1)))
    box = [(adapters, tx.init(adapters))]

    def ours():
        box[0] = step(*box[0])
        sync()

    module = TorchGPT2(model.config).load_cfx(params).to(device, torch.bfloat16)
    pm = peft.get_peft_model(module, peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q", "k", "v", "o", "fc", "proj"]))
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4, fused=device == "cuda")

    def theirs():
        autocast_step(pm, opt, tokens, targets)
        sync()

    n_ours, n_theirs = cfx.tree.size(adapters), sum(p.numel() for p in pm.parameters() if p.requires_grad)
    t_ours, t_theirs = interleaved_medians([ours, theirs], rounds=rounds, warmup=2)
    ratio = t_ours / t_theirs
    return [Row(f"  LoRA step GPT-2 small B{B}x{T} r=16: cfx / peft{tag}", t_ours * 1e3,
                f"ms vs {t_theirs * 1e3:.2f} ms; {n_ours:,} vs {n_theirs:,} trained params"),
            Row(f"lora_step_vs_peft_gpu (cfx / peft step time){tag}", ratio, "x", "<= 1.00", ratio <= 1.0)]
