"""Sequence parallelism: what each method sends per layer, against its formula.

A GPT-2 (fp32) trains one forward + backward with its sequence split over a ``seq`` axis of N
local ranks; ``cfx.comm_stats`` counts the payload rank 0 contributes on that axis, per layer,
next to each method's textbook figure for one layer with local blocks of ``B x T/N`` positions,
``H`` heads, ``Hkv`` kv heads of size ``D``:

* ring: forward N-1 hops of the k/v block (``2 B T/N Hkv D``), backward N-1 hops of it and N of
  its fp32 gradient accumulators (the last one home);
* ulysses: 4 all-to-alls of ``B T/N H D`` each way (q, k, v in, the output back; the backward
  runs their transposes);
* hybrid: the two above, Ulysses over ``seq`` (2 ranks) and the ring over ``ring`` on blocks of
  twice the positions with half the heads (the same bytes as a block of its own positions);
* Megatron-SP (``tensor_parallel(sequence=True)`` over ``model``): the bytes on the wire of plain
  tensor parallelism's all-reduces (an all-gather plus a reduce-scatter each), measured side by
  side as the difference between a 2- and a 1-block model (so only a block's collectives count).

Rows ``<method>_bytes_vs_formula`` (target 1.00); then ``sequence_memory``'s rows: activation
bytes per rank against 1/N, and ``<method>_max_seq_vs_tp``, the longest sequence under a
per-rank activation budget against tensor parallelism's.
"""
from __future__ import annotations


import cfx
from cfx import P
from cfx.bench.common import Row, report, size_of
from cfx.bench.sequence_memory import rows as memory_rows


def measured_and_formula(method: str, n: int, *, n_layer: int = 2, B: int = 2, T: int = 64) -> tuple[float, float]:
    """Payload bytes per layer per rank on the sequence axes (fwd + bwd) and the method's formula
    (``"hybrid"``: a ring of ``n`` over ``ring`` by Ulysses over 2 ranks of ``seq``)."""
    model = cfx.models.gpt2("tiny", n_layer=n_layer, vocab_size=256, n_positions=T, n_embd=64, n_head=4)
    params = model.init(cfx.random.key(0))
    tokens = cfx.random.randint(cfx.random.key(1), (B, T + 1), 0, 256)
    hybrid = method == "hybrid"
    sp = cfx.parallel.sequence_parallel(model, ("ring", "seq") if hybrid else "seq", method=method)
    order = sp.sublayers()["sequence"].order(T, n)
    shape, spec = ({"ring": n, "seq": 2}, P(None, ("ring", "seq"))) if hybrid else ({"seq": n}, P(None, "seq"))
    with cfx.Mesh(shape) as mesh, cfx.comm_stats() as stats:
        cfx.shard_map(lambda p, x, y: cfx.value_and_grad(sp.loss)(p, x, y)[0], mesh=mesh,
                      in_specs=(P(), spec, spec), out_specs=P())(
            params, tokens[:, :-1][:, order], tokens[:, 1:][:, order])
    H, D, tl = 4, 64 // 4, T // (n * (2 if hybrid else 1))
    block = 2 * B * tl * H * D  # k and v of this rank's positions (GPT-2: Hkv = H); under hybrid also
    # the ring's block: U times the positions with 1/U of the heads
    ring = ((n - 1) * block * 4 + (n - 1) * block * 4 + n * block * 4)  # fwd k/v, bwd k/v, bwd fp32 dk/dv
    a2a = 2 * 4 * (B * tl * H * D) * 4  # 4 all-to-alls forward, 4 backward, fp32
    ops = {"ring": [("ppermute", "seq")], "ulysses": [("all_to_all", "seq")],
           "hybrid": [("ppermute", "ring"), ("all_to_all", "seq")]}[method]
    measured = sum(stats.bytes(op=op, axes=axis, rank=0) for op, axis in ops) / n_layer
    return measured, {"ring": ring, "ulysses": a2a, "hybrid": ring + a2a}[method]


WIRE = {"all_gather": lambda n: n - 1, "reduce_scatter": lambda n: (n - 1) / n,
        "all_reduce": lambda n: 2 * (n - 1) / n}  # bytes a rank sends per payload byte (ring algorithms)


def megatron_and_tp_wire(n: int, *, B: int = 2, T: int = 64) -> tuple[float, float]:
    """Bytes on the wire per rank for one block, Megatron-SP and plain TP, over ``{"model": n}``."""
    def wire(sequence: bool, n_layer: int) -> float:
        model = cfx.models.gpt2("tiny", n_layer=n_layer, vocab_size=256, n_positions=T, n_embd=64, n_head=4)
        net = cfx.parallel.tensor_parallel(model, "model", vocab=False, sequence=sequence)
        tokens = cfx.random.randint(cfx.random.key(1), (B, T + 1), 0, 256)
        rules = {k: v for k, v in cfx.parallel.MEGATRON_RULES.items() if k != "vocab"}
        b = P(None, "model") if sequence else P()
        with cfx.Mesh({"model": n}) as mesh, cfx.comm_stats() as stats:
            specs = cfx.Rules(rules).specs(model.axes(), mesh=mesh)
            cfx.shard_map(lambda p, x, y: cfx.value_and_grad(net.loss)(p, x, y)[0], mesh=mesh,
                          in_specs=(specs, b, b), out_specs=P())(model.init(cfx.random.key(0)), tokens[:, :-1],
                                                                 tokens[:, 1:])
        return sum(r.nbytes * WIRE[r.op](n) for r in stats.select(axes="model", rank=0) if r.op in WIRE)
    return wire(True, 2) - wire(True, 1), wire(False, 2) - wire(False, 1)


def run(*, quick: bool = False, smoke: bool = False, json_path: str | None = None) -> dict:
    size = size_of(quick=quick, smoke=smoke)
    T = 16 if size == "smoke" else 64
    rows = []
    for method in ("ring", "ulysses", "hybrid"):
        for n in ((2,) if size != "full" or method == "hybrid" else (2, 4)):
            measured, formula = measured_and_formula(method, n, T=T)
            ratio = measured / formula
            where = f"ring={n} x seq=2" if method == "hybrid" else f"seq={n}"
            rows.append(Row(f"{method}_bytes_vs_formula, {where} (per layer, fwd+bwd, rank 0)", ratio, "x", "1.00",
                            abs(ratio - 1.0) < 1e-9))
            rows.append(Row(f"  {method} payload per layer, {where}", measured, "B"))
    for n in ((4,) if size != "full" else (2, 4)):
        sp, tp = megatron_and_tp_wire(n, T=T)
        rows.append(Row(f"megatron_bytes_vs_formula, model={n} (wire bytes per block vs TP's all-reduces)", sp / tp,
                        "x", "1.00", abs(sp / tp - 1.0) < 1e-9))
        rows.append(Row(f"  megatron-SP wire bytes per block, model={n}", sp, "B"))
    rows += memory_rows(size=size)
    return report("sequence", rows, json_path)
