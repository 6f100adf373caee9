"""What GPT-2 and Llama share: input checks, the block loop, the fp32 loss, ``map_blocks``."""
from __future__ import annotations

import ast
import dataclasses
import operator
import weakref
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from cfx._src.core import random
from cfx._src.core import tree as tree_util
from cfx._src.nn.embedding import Embedding
from cfx._src.nn.linear import split_keys
from cfx._src.nn.lora_weight import is_weight_node, weight_nodes_as_leaves
from cfx._src.nn.sublayers import keep_sublayers
from cfx._src.nn.vocab import TokenLoss
from cfx._src.nn.loss import IGNORE_INDEX
from cfx._src.remat.chained import chain_runner, take_chain_runner
from cfx._src.transforms.regional import block_apply
from cfx._src.transforms.shapes import is_abstract


def config_from_preset(cls: Any, presets: dict, name: str, overrides: dict) -> Any:
    """``cls(**presets[name], **overrides)``, with ValueErrors naming the valid presets / fields. ``name``
    may carry overrides of its own, Python literals after commas (how a command line's ``--preset`` sets
    fields): ``"tiny,n_layer=4,router_aux_group_size=128"``; ``overrides`` take precedence."""
    name, *pairs = str(name).split(",")
    overrides = {**_parse_overrides(cls, name, pairs), **overrides}
    if name not in presets:
        raise ValueError(f"{cls.__name__}.preset: unknown preset {name!r}; valid names are "
                         f"{sorted(presets)}.")
    fields = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ValueError(f"{cls.__name__}.preset: unknown field(s) {bad}; valid fields are "
                         f"{sorted(fields)}.")
    return cls(**{**presets[name], **overrides})


def _parse_overrides(cls: Any, name: str, pairs: list[str]) -> dict:
    """``["n_layer=4", "rope_theta=1e6"]`` -> ``{"n_layer": 4, "rope_theta": 1e6}`` (a value that is no
    Python literal stays a string)."""
    out = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not (sep and key.strip().isidentifier()):
            raise ValueError(f"{cls.__name__}.preset: {pair!r} in {','.join([name, *pairs])!r} is not field=value; "
                             "write the preset's name, then its overrides, e.g. 'tiny,n_layer=4'.")
        try:
            out[key.strip()] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = text.strip()
    return out


def check_params(where: str, model: Any, params: Any) -> None:
    """ValueError naming the differing leaf paths if ``params`` is not shaped like ``model.init``'s
    (skipped while ``torch.compile`` traces, which cannot follow the tree library: a params tree of
    another structure then fails in the model's ops instead of with this message)."""
    if torch.compiler.is_dynamo_compiling():
        return
    # one walk: cfx.quant.quantize turns a weight leaf into a QuantizedWeight(q, scale) node,
    # cfx.lora.attach into a LoraWeight(base, A, B) node, each one weight of the model's structure
    leaves = tree_util.leaves_as(params, _params_structure(model))  # the usual case, quickly
    if leaves is not None:
        if len(set(map(_dtype, leaves))) > 1:  # (tensors all: one C-level pass when they agree)
            _check_one_float_dtype(where, params, leaves)
        return
    leaves, treedef = tree_util.flatten(params, is_leaf=is_weight_node)
    if treedef != _params_structure(model):
        ref = tree_util.map(lambda a: 0, model.axes(), is_leaf=tree_util.is_axes_leaf)
        what = (f"{where}: params differ from {type(model).__name__}.init's structure "
                "(were they made by a model with another config or layout?)")
        tree_util.check_same_structure(what, ref, weight_nodes_as_leaves(params))
    _check_one_float_dtype(where, params, leaves)


def _check_one_float_dtype(where: str, params: Any, leaves: list) -> None:
    """ValueError naming the odd leaves if the floating params mix dtypes (quantized weights and LoRA
    adapters aside); ``leaves`` are ``params``' with those weights as single leaves."""
    dtypes = {x.dtype for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()}
    if len(dtypes) <= 1:
        return
    items = [(p, x.dtype) for p, x in tree_util.flatten_with_path(weight_nodes_as_leaves(params))[0]
             if isinstance(x, torch.Tensor) and x.is_floating_point()]
    common = max(dtypes, key=lambda d: sum(dt == d for _, dt in items))
    odd = [f"{p} ({dt})" for p, dt in items if dt != common]
    raise ValueError(f"{where}: params mix dtypes: {', '.join(odd[:5])}{' ...' if len(odd) > 5 else ''} "
                     f"where the other {len(items) - len(odd)} are {common}. Cast the tree to one dtype "
                     f"(cfx.tree.map(lambda x: x.to({common}), params)), or keep fp32 params and compute in "
                     "another dtype with a cfx.amp policy.")


_dtype = operator.attrgetter("dtype")
_STRUCTURES: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _params_structure(model: Any) -> Any:
    """The tree structure of ``model.init``'s params, from its axes; kept per model (equal
    configurations share one), since every call of a model's ``apply`` checks against it."""
    try:
        return _STRUCTURES[model]
    except (KeyError, TypeError):  # not seen yet, or a model that cannot be a key
        pass
    ref = tree_util.structure(tree_util.map(lambda a: 0, model.axes(), is_leaf=tree_util.is_axes_leaf))
    try:
        _STRUCTURES[model] = ref
    except TypeError:
        pass
    return ref


def _check_int_2d(where: str, name: str, x: Any) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{where}: {name} must be a 2-D integer tensor (B, T), got {type(x).__name__}.")
    if x.dim() != 2 or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{where}: {name} must be a 2-D integer tensor (B, T), got a {x.dim()}-D "
                         f"tensor of dtype {x.dtype} and shape {tuple(x.shape)}.")


def check_inputs(where: str, tokens: Any, mask: Any, *, vocab_size: int, max_len: int,
                 max_len_name: str) -> None:
    """Validate tokens ``(B, T)`` (ids in range, ``T <= max_len``) and an optional bool mask."""
    _check_int_2d(where, "tokens", tokens)
    B, T = tokens.shape
    if B == 0 or T == 0:
        raise ValueError(f"{where}: tokens must be non-empty, got shape {tuple(tokens.shape)}.")
    if T > max_len:
        raise ValueError(f"{where}: sequence length {T} exceeds {max_len_name}={max_len}. Crop the "
                         f"sequence, or build the model with {max_len_name}>={T}.")
    if not is_abstract(tokens) and not _asserted_on_device(where, "token", tokens, vocab_size):
        lo, hi = (int(v) for v in torch.aminmax(tokens))  # one reduction: cheap next to the forward
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{where}: token ids must lie in [0, vocab_size={vocab_size}), got ids in "
                             f"[{lo}, {hi}].")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (B, T):
            got = (f"dtype {mask.dtype}, shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor)
                   else type(mask).__name__)
            raise ValueError(f"{where}: mask must be a bool tensor of the tokens' shape {(B, T)} "
                             f"(True = real token), got {got}.")


def _asserted_on_device(where: str, what: str, ids: torch.Tensor, vocab_size: int, *, ignore: int | None = None
                        ) -> bool:
    """On an accelerator, check that ``ids`` (but ``ignore``) lie in ``[0, vocab_size)`` with an
    asynchronous device-side assertion, and say so (True): reading the range back would make the
    host wait for the device every step, so the launches could no longer run ahead of the kernels.
    A bad id still stops the run, with this message in the device's error, never silently. On the
    CPU, False: the caller reads the range (one cheap reduction) and raises a ValueError."""
    if ids.device.type == "cpu":
        return False
    ok = (ids >= 0) & (ids < vocab_size)
    if ignore is not None:
        ok |= ids == ignore
    torch._assert_async(ok.all(), f"{where}: {what} ids must lie in [0, vocab_size={vocab_size})"
                        + (f" or be {ignore}" if ignore is not None else ""))
    return True


def check_targets(where: str, tokens: torch.Tensor, targets: Any, *, vocab_size: int) -> None:
    _check_int_2d(where, "targets", targets)
    if targets.shape != tokens.shape:
        raise ValueError(f"{where}: targets shape {tuple(targets.shape)} differs from tokens shape "
                         f"{tuple(tokens.shape)}; targets[b, t] is the token that should follow "
                         "tokens[b, t] (use -100 to ignore a position).")
    if is_abstract(targets) or _asserted_on_device(where, "target", targets, vocab_size, ignore=IGNORE_INDEX):
        return
    if not targets.numel():
        return
    lo, hi = (int(v) for v in torch.aminmax(targets))  # one reduction, usually enough
    if lo >= 0 and hi < vocab_size:
        return
    valid = targets[targets != IGNORE_INDEX]
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab_size):
        raise ValueError(f"{where}: target ids must lie in [0, vocab_size={vocab_size}) or be -100, "
                         f"got ids in [{int(valid.min())}, {int(valid.max())}].")


def _head_logits(head: Any, params: dict, h: torch.Tensor) -> torch.Tensor:
    """A head's logits of ``h``: a tied embedding table attends (``attend``), any other head applies."""
    return head.attend(params, h) if callable(getattr(head, "attend", None)) else head.apply(params, h)


def init_blocks(blocks: tuple, key: torch.Tensor) -> list:
    """Each block's ``init`` from its own key (``split_keys(key, len(blocks))``). In a shape-only trace (a
    fake key: ``eval_shape`` of an init, how a Plan lays params out and the estimate accounts them) a block
    object met before gives the params it gave then -- the same shapes -- without tracing its init again:
    a 128-layer model's took a second of fake ops."""
    keys = split_keys(key, len(blocks))
    if not is_fake(key):
        return [b.init(k) for b, k in zip(blocks, keys)]
    made: dict[int, Any] = {}
    return [made[id(b)] if id(b) in made else made.setdefault(id(b), b.init(k)) for b, k in zip(blocks, keys)]


def dropout_keys(key: torch.Tensor | None, rate: float, n: int) -> list[torch.Tensor | None]:
    """``n`` keys for the dropout sites, or ``n`` Nones when there is no dropout to do."""
    if key is None or rate == 0.0:
        return [None] * n
    return list(random.split(key, n))


class DecoderLM:
    """Mixin for frozen-dataclass models with ``config``, ``blocks`` (a tuple of block layers) and
    named sublayers (``_build_layers``: embeddings, norms, the head, a language model's ``"loss"``),
    any of which ``layers`` replaces -- as ``blocks`` replaces the blocks -- with a layer of the same
    params: how a parallel strategy swaps in its forms (``cfx.parallel.tensor_parallel``'s
    vocabulary-parallel embedding, head and loss, under which ``apply`` returns this rank's logits
    shard). The model's code runs whatever its sublayers are and never names a split."""

    blocks: tuple
    layers: tuple   # (name, layer) pairs replacing sublayers of _build_layers
    max_len_name: str  # the config field bounding the sequence length

    def _init_blocks(self, default_block: Callable[[], Any], n_layer: int) -> None:
        """``blocks`` defaults to ``n_layer`` copies of ``default_block()`` (given blocks must number
        ``n_layer``); then the named sublayers of ``_build_layers``, with ``layers`` replacing theirs,
        are built once (``keep_sublayers``)."""
        if self.blocks is None:
            object.__setattr__(self, "blocks", (default_block(),) * n_layer)
        elif len(self.blocks) != n_layer:
            raise ValueError(f"{type(self).__name__}: got {len(self.blocks)} blocks for n_layer={n_layer}.")
        built = self._build_layers()
        padable = {"vocab_pad"} if isinstance(built.get("loss"), TokenLoss) else set()  # (cfx.models.pad_vocab)
        unknown = sorted(set(dict(self.layers)) - set(built) - padable)
        if unknown:
            raise ValueError(f"{type(self).__name__}: layers= replaces {unknown}, which it does not have; its "
                             f"sublayers are {sorted(built)}.")
        keep_sublayers(self, {**built, **dict(self.layers)})

    def _layers(self) -> dict:
        return self._sublayers

    def sublayers(self) -> dict:
        """The named layers around the blocks (a copy): what ``with_layers`` may replace."""
        return dict(self._sublayers)

    def with_layers(self, **layers: Any):
        """A copy of the model with the named sublayers replaced (same params, other computation)."""
        return dataclasses.replace(self, layers=tuple({**dict(self.layers), **layers}.items()))

    @property
    def real_vocab_size(self) -> int:
        """The ids the vocabulary holds: ``config.vocab_size`` less what ``cfx.models.pad_vocab`` padded."""
        pad = self._sublayers.get("vocab_pad")
        return self.config.vocab_size if pad is None else pad.size

    @property
    def logits_axis(self) -> str | None:
        """The mesh axis the logits' last dim is split over (its loss layer's: a vocabulary split), or None."""
        return getattr(self._sublayers.get("loss"), "logits_axis", None)

    def map_blocks(self, f: Callable[[Any], Any]):
        """A copy of the model whose blocks are ``f(block)`` (same ``init`` / ``apply`` / ``axes``)."""
        return dataclasses.replace(self, blocks=tuple(f(b) for b in self.blocks))

    def run_blocks(self, params: list, x: torch.Tensor, *, mask: torch.Tensor | None,
                   keys: list, positions: torch.Tensor | None = None, cache: Any = None) -> torch.Tensor:
        # x (B, T, C) -> (B, T, C), through each block's own apply (so wrapped blocks take effect);
        # with a KVCache, every block appends its keys and values, then the cache advances by T
        if cache is not None:
            if len(cache.k) != len(self.blocks):
                raise ValueError(f"{type(self).__name__}: a KVCache of {len(cache.k)} layers for {len(self.blocks)} "
                                 "blocks; make it with n_layers=len(model.blocks).")
            for i, (block, p) in enumerate(zip(self.blocks, params)):
                x = block.apply(p, x, mask=mask, positions=positions, cache=cache.layer(i))
            cache.advance(x.shape[1])
            return x
        extra = {} if positions is None else {"positions": positions}
        runner = take_chain_runner()
        if runner is not None:  # the blocks as one chain, under a checkpointing schedule (cfx.remat.Chained)
            with chain_runner(None):
                return runner.run([b.apply for b in self.blocks], params, x,
                                  [dict(mask=mask, key=k, **extra) for k in keys])
        for block, p, k in zip(self.blocks, params, keys):  # compiled once each under jit(compile="blocks")
            x = block_apply(block)(p, x, mask=mask, key=k, **extra)
        return x

    def loss(self, params: Any, tokens: torch.Tensor, targets: torch.Tensor, *,
             mask: torch.Tensor | None = None, key: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy (fp32) of ``apply``'s logits against ``targets`` (-100 = ignore).

        ``targets[b, t]`` is the token expected after ``tokens[b, t]`` (no shift happens here).
        """
        where = f"{type(self).__name__}.loss"
        _check_int_2d(where, "tokens", tokens)
        check_targets(where, tokens, targets, vocab_size=self.real_vocab_size)
        return self.head_loss(params, self.hidden(params, tokens, mask=mask, key=key), targets)

    def logits(self, params: Any, x: torch.Tensor) -> torch.Tensor:
        """The head's logits ``(B, T, V)`` (this rank's ``(B, T, V/n)`` under a vocabulary split) for the
        last block's output ``x`` (B, T, C); ``_head_parts`` says what the head is."""
        h, head, p = self._head_parts(params, x)
        return self._vocab_logits(head, p, h)

    def _vocab_logits(self, head: Any, params: Any, h: torch.Tensor) -> torch.Tensor:
        return self.mask_padding(_head_logits(head, params, h))

    def mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (B, T, V) -- this rank's (B, T, V/n) under a vocabulary split -- with the ids a padded
        vocabulary added (``cfx.models.pad_vocab``) masked out of every softmax."""
        pad = self._sublayers.get("vocab_pad")
        return logits if pad is None else pad.mask(logits, self.logits_axis)

    def head_loss(self, params: Any, x: torch.Tensor, targets: torch.Tensor, *,
                  fused: bool | None = None) -> torch.Tensor:
        """The mean loss of the last block's output ``x`` (B, T, C) against ``targets`` (B, T).

        ``fused`` (default: on CUDA) computes the head's matmul and the loss together in chunks
        (``cfx_kernels.linear_cross_entropy``), so the (B T, V) logits never exist; a loss that is not
        the plain token loss (a split vocabulary), a sequence split over an axis and an int8 head take
        the unfused path."""
        h, head, p = self._head_parts(params, x)
        w = p["w"]
        if fused is None:
            fused = h.is_cuda
        plain = getattr(self._layers().get("loss"), "fusable", False) and self._layers().get("vocab_pad") is None
        if not fused or not plain or not isinstance(w, torch.Tensor):
            return self.logits_loss(self._vocab_logits(head, p, h), targets)
        from cfx_kernels.linear_cross_entropy import linear_cross_entropy

        weight = w if isinstance(head, Embedding) else w.T  # (V, C): an embedding's rows; a Linear's (C, V).T
        return linear_cross_entropy(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), bias=p.get("b"))

    def logits_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's loss layer on logits (B, T, V) -- this rank's (B, T, V/n) under a vocabulary split."""
        return self._layers()["loss"](logits, targets)

    def position_rows(self, table: torch.Tensor, T: int) -> torch.Tensor:
        """The rows of a learned position table (P, C) for the ``T`` tokens a call sees: the first
        ``T``, or those of this rank's share of the sequence when it is split over a mesh axis
        (its ``"sequence"`` sublayer's: ``sequence_parallel`` swaps in the split)."""
        return self._layers()["sequence"].rows(table, T)

    def check_call(self, where: str, params: Any, tokens: Any, mask: Any, cache: Any = None) -> None:
        """``apply``'s checks of its tokens, mask and params -- skipped for the calls with a KV cache
        whose caller checked them (``KVCache.validated``: ``cfx.generate``'s decode steps), since the
        token check reads the ids back to the host, a sync per token on a GPU."""
        if cache is not None and cache.validated:
            return
        name = self.max_len_name
        check_inputs(where, tokens, mask, vocab_size=self.real_vocab_size, max_len=getattr(self.config, name),
                     max_len_name=name)
        check_params(where, self, params)

    def check_batch(self, where: str, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        """``check_inputs`` and ``check_targets`` against this model's vocabulary and context."""
        name = self.max_len_name
        check_inputs(where, tokens, None, vocab_size=self.real_vocab_size,
                     max_len=getattr(self.config, name), max_len_name=name)
        check_targets(where, tokens, targets, vocab_size=self.real_vocab_size)

    def embed(self, emb_layer: Any, emb_params: dict, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings (B, T, C) from the embedding layer (from this rank's shard of the rows when
        that layer is vocabulary-parallel)."""
        return emb_layer.apply(emb_params, tokens)
