"""One candidate of ``python -m cfx.bench capacity``, in its own process under the bench's cap.

``python -m cfx.bench.capacity_worker KIND WIDTH LAYERS --vocab V --seq T --steps N --out FILE
[--dir DIR] [--digest]`` trains a GPT-2 of that shape (``WIDTH // 64`` heads, 1024 positions, fp32,
batch 1, AdamW at lr 1e-4 on one batch of random tokens of a fixed seed, every step) for N steps and writes JSON: the
parameter count, the loss and seconds of every step, and for ``nvme`` the bytes and seconds of file
I/O of every step; ``--digest`` adds a SHA-256 of the final params (model coordinates, flatten order).

KIND: ``pytorch`` (transformers' ``GPT2LMHeadModel`` + ``torch.optim.AdamW``), ``cfx`` (a
``cfx.parallel.Program`` of ``data=1 zero=3 remat=blocks`` on one rank: everything in memory; bit for
bit the numbers of ``nvme``), ``nvme``
(``cfx.zero.GeminiEngine.from_init`` with ``offload(host(), nvme_dir=DIR)``: params, gradients
and moments in files under DIR, blocks under remat, streamed with read-ahead).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch

LR = 1e-4
PLAN = "data=1 zero=3 remat=blocks"  # in memory, the same numbers as the nvme engine's (one rank: no sharding)


def tokens_for(vocab: int, seq: int, steps: int) -> torch.Tensor:
    """One batch of random tokens, repeated every step (so that 3 steps show the loss falling)."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (1, 1, seq + 1), generator=g).expand(steps, 1, seq + 1)


def digest(leaves) -> str:
    h = hashlib.sha256()
    for x in leaves:
        h.update(x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_pytorch(a, out: dict) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=a.vocab, n_positions=1024, n_embd=a.width, n_layer=a.layers,
                     n_head=max(1, a.width // 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    out["params"] = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for t in tokens_for(a.vocab, a.seq, a.steps):
        t0 = time.perf_counter()
        loss = model(input_ids=t[:, :-1], labels=t[:, :-1]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_done(out, loss.item(), time.perf_counter() - t0)
    if a.digest:
        out["digest"] = digest(p for p in model.parameters())


def model_of(a):
    import cfx
    return cfx.models.gpt2("tiny", n_layer=a.layers, n_embd=a.width, n_head=max(1, a.width // 64),
                           vocab_size=a.vocab, n_positions=1024)


def train_cfx(a, out: dict) -> None:
    import cfx
    model = model_of(a)
    plan = cfx.parallel.Plan.parse(PLAN)
    with plan.make_mesh() as mesh:
        prog = cfx.parallel.Program(plan, model, cfx.optim.adamw(LR), mesh)
        state = prog.init(cfx.random.key(0))
        out["params"] = sum(x.numel() for x in cfx.tree.leaves(cfx.eval_shape(model.init, cfx.random.key(0))))
        for t in tokens_for(a.vocab, a.seq, a.steps):
            t0 = time.perf_counter()
            state, m = prog(state, (t[:, :-1], t[:, 1:]))
            step_done(out, float(m["loss"]), time.perf_counter() - t0)
        if a.digest:
            out["digest"] = digest(cfx.tree.leaves(prog.params(state)))


def largest_group(model, key) -> int:
    """Elements of the largest gathered layer's own params (a block, or the embedding with what else
    is outside the blocks): chunks no larger, so that the fewest bytes sit in memory at once."""
    import cfx
    root, blocks = 0, {}
    for path, x in cfx.tree.flatten_with_path(cfx.eval_shape(model.init, key))[0]:
        if path.startswith("blocks."):
            b = path.split(".")[1]
            blocks[b] = blocks.get(b, 0) + x.numel()
        else:
            root += x.numel()
    return max(root, *blocks.values())


def train_nvme(a, out: dict) -> None:
    import cfx
    from cfx import P, zero
    model = model_of(a)
    net = zero.gathered(model.map_blocks(lambda b: cfx.remat(zero.gathered(b, axis="data"))), axis="data")
    key = cfx.random.key(0)
    out["params"] = sum(x.numel() for x in cfx.tree.leaves(cfx.eval_shape(model.init, key)))
    batches = tokens_for(a.vocab, a.seq, a.steps)

    def body():
        t0 = time.perf_counter()
        engine = zero.GeminiEngine.from_init(net, model.init, key, cfx.optim.adamw(LR), axis="data",
                                             offload=zero.offload(cfx.gemini.host(), nvme_dir=a.dir),
                                             max_chunk_size=largest_group(model, key))
        out["init_s"] = time.perf_counter() - t0
        out["chunk_bytes"], out["chunks"] = engine.chunk_bytes[0], engine.chunks.n_chunks
        out["slice_bytes"] = engine.tiers.slice * 4
        out["io"] = []
        for t in batches:
            before, t0 = engine.io, time.perf_counter()
            loss = engine.backward(lambda p: net.loss(p, t[:, :-1], t[:, 1:]))
            engine.update()
            after = engine.io
            out["io"].append({k: after[k] - before[k] for k in after})
            step_done(out, float(loss), time.perf_counter() - t0)
        if a.digest:
            out["digest"] = digest(cfx.tree.leaves(zero.gather_params(engine.params(), axis="data")))
        engine.close()
        return torch.zeros(1)

    with cfx.Mesh({"data": 1}) as mesh:
        cfx.shard_map(body, mesh=mesh, in_specs=(), out_specs=P())()


def step_done(out: dict, loss: float, seconds: float) -> None:
    out.setdefault("losses", []).append(loss)
    out.setdefault("step_s", []).append(seconds)
    print(f"  step {len(out['losses'])}: loss {loss:.4f}, {seconds:.1f} s", file=sys.stderr, flush=True)
    with open(out["_path"], "w") as f:  # what was done so far survives a kill
        json.dump({k: v for k, v in out.items() if k != "_path"}, f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cfx.bench.capacity_worker")
    p.add_argument("kind", choices=["pytorch", "cfx", "nvme"])
    p.add_argument("width", type=int)
    p.add_argument("layers", type=int)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--digest", action="store_true")
    a = p.parse_args(argv)
    if a.kind == "nvme" and not a.dir:
        p.error("nvme needs --dir")
    out = {"kind": a.kind, "width": a.width, "layers": a.layers, "_path": a.out}
    {"pytorch": train_pytorch, "cfx": train_cfx, "nvme": train_nvme}[a.kind](a, out)
    out["done"] = True
    with open(a.out, "w") as f:
        json.dump({k: v for k, v in out.items() if k != "_path"}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
