"""Functional layers: frozen dataclasses with ``init(key)``, ``apply(params, ...)``, ``axes()``.

``init`` returns a dict of fp32 tensors drawn from an explicit ``cfx.random`` key; ``apply`` is
pure and computes in the params' dtype; ``axes`` returns the same structure as the params with
one logical axis name per tensor dim. Linear weights are ``(in_features, out_features)``.

Logical axis names (map them to mesh axes with ``cfx.Rules``):

``"vocab"``     token vocabulary (embedding rows, untied LM head columns)
``"embed"``     the residual stream / model width ``C``
``"mlp"``       the MLP hidden width (``fc`` / ``gate`` / ``up`` outputs, ``proj`` / ``down`` inputs)
``"heads"``     query heads times head dim, flattened (``q`` outputs, ``o`` inputs)
``"kv_heads"``  key/value heads times head dim, flattened (``k`` and ``v`` outputs)
``"positions"`` learned position-embedding rows (GPT-2's ``wpe``)
``"embed_proj"`` a projected embedding's narrower width (OPT-350m's ``wte``, ``project_in`` / ``out``)
``"conv_out"`` / ``"conv_in"`` / ``"kernel"``  a ``Conv2d``'s output and input channels and its window
``"experts"``   a mixture of experts' experts (``MoE``: the first dim of its expert weights)

``KVCache`` holds attention's keys and values while decoding (``cfx.generate``). ``MoE`` is a sparse
mixture of SwiGLU experts behind a top-k router; ``RouterStats``, ``load_balancing_loss`` and ``z_loss``
are what its router reports and the auxiliary losses made of it.

So ``Rules({"mlp": "model", "heads": "model", "kv_heads": "model"})`` is Megatron tensor
parallelism: q/k/v/fc/gate/up column-parallel, o/proj/down row-parallel.
"""
from cfx._src.nn.attention import Attention, attention
from cfx._src.nn.block import TransformerBlock
from cfx._src.nn.conv import Conv2d
from cfx._src.nn.dropout import Dropout, dropout
from cfx._src.nn.embedding import Embedding
from cfx._src.nn.kv_cache import KVCache
from cfx._src.nn.linear import Linear
from cfx._src.nn.mlp import MLP, activation
from cfx._src.nn.moe import MoE, RouterStats, load_balancing_loss, z_loss
from cfx._src.nn.norm import GroupNorm, LayerNorm, RMSNorm
from cfx._src.nn.rope import apply_rope, rope_cos_sin, rotate_half

__all__ = [
    "KVCache", "MLP", "Attention", "Conv2d", "Dropout", "Embedding", "GroupNorm", "LayerNorm", "Linear", "RMSNorm",
    "MoE", "RouterStats", "TransformerBlock", "activation", "apply_rope", "attention", "dropout",
    "load_balancing_loss", "rope_cos_sin", "rotate_half", "z_loss",
]
