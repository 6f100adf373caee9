"""One pipeline step on one rank (``PipelineStep`` runs it): the schedule's actions in order, and the
state that lives from a microbatch's F to its B / W (see ``executor``'s module doc for the actions;
the messages between stages: ``messages``)."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from cfx._src.mesh import memory
from cfx._src.core import tree as tree_util
from cfx._src.lax import collectives as lax
from cfx._src.nn.loss import IGNORE_INDEX
from cfx._src.parallel.state import tree_psum
from cfx._src.pipeline import trace as trace_lib
from cfx._src.pipeline.backward import SplitBackward
from cfx._src.pipeline.messages import Messages
from cfx._src.remat.saved import SavedTensors, storage_keys
from cfx._src.transforms.shapes import is_abstract
from cfx._src.zero.params import ShardedLeaf

WHERE = "cfx.pipeline"
FORWARD = ("F", "SEND_F", "RECV_F")  # what an evaluation runs of a schedule


class Run:
    """One step on one rank: the state that lives from a microbatch's F to its B / W."""

    def __init__(self, step: Any, params, tokens, targets, rank: int, *, forward_only: bool = False):
        self.step, self.params, self.rank, self.forward_only = step, params, rank, forward_only
        sched, plan = step.schedule, step.plan
        m = sched.n_microbatches
        self.tokens, self.targets = tokens.chunk(m), targets.chunk(m)  # m x (b, T)
        # a microbatch's share of the mean: its targets that count (-100 ignored; shapes only, or float
        # targets: all of them)
        self.valid = [t.numel() if is_abstract(t) or t.is_floating_point() else int((t != IGNORE_INDEX).sum())
                      for t in self.targets]
        total = max(sum(self.valid), 1)
        self.weights = [v / total for v in self.valid]  # microbatch shares of the mean loss
        w = _grad_leaf(tree_util.leaves(params)[0])
        self.messages = Messages(step, dict(shape=step.parts.activation_shape(self.tokens[0].shape), dtype=w.dtype,
                                            device=w.device), fp8=step.fp8_sends)
        # this rank's params as fresh leaves, and each stage's list of them
        mine = sched.stages_of(rank)
        held = {k for s in mine for k in plan.extras(s)}
        self.local = {k: _leaves_of(params[k]) for k in held}
        held = step.held_blocks(rank)
        self.where = {i: (held.index(i) if step.local_blocks else i) for i in held}  # block -> params position
        self.local["blocks"] = {i: _leaves_of(params["blocks"][self.where[i]]) for i in held}
        self.stage_leaves = {s: [_grad_leaf(x) for x in tree_util.leaves(
                                 [self.local["blocks"][i] for i in plan.blocks(s)] + [self.local[k] for k in plan.extras(s)])]
                             for s in mine}
        # saved tensors are watched only while a cfx.memory tracker is active (the hook costs time)
        self.tracked = memory.is_tracking()
        self.param_storages = storage_keys(_grad_leaf(t) for t in tree_util.leaves(params))
        self.sums = WeightGrads()                 # what W computed, summed over microbatches
        self.inputs: dict[tuple, torch.Tensor] = {}   # (stage, mb) -> stage input
        self.outputs: dict[tuple, torch.Tensor] = {}  # (stage, mb) -> output to send
        self.out_grads: dict[tuple, torch.Tensor] = {}  # (stage, mb) -> gradient of its output
        self.in_grads: dict[tuple, torch.Tensor] = {}   # (stage, mb) -> gradient of its input, to send
        self.live: dict[tuple, tuple] = {}        # (stage, mb) -> (root, x) awaiting B / I
        self.split: dict[tuple, SplitBackward] = {}  # (stage, mb) -> awaiting W
        self.scale = None
        self.loss = torch.zeros((), dtype=torch.float32, device=w.device)

    # -- the action loop ------------------------------------------------------------------------
    def execute(self, ctx) -> None:
        step = self.step
        collectors = trace_lib.active()
        events = []
        actions = [a for a in step.schedule.actions[self.rank] if not self.forward_only or a.kind in FORWARD]
        self.messages.start(actions)
        for a in actions:
            t0 = time.perf_counter()
            getattr(self, "_" + a.kind)(a.stage, a.microbatch, a.peer)
            events.append((a, t0, time.perf_counter()))
            self.messages.reap()
        self.messages.finish()
        assert not (self.inputs or self.outputs or self.out_grads or self.in_grads or self.live
                    or self.split), "a validated schedule consumes everything it produces"
        group = tuple((n, c) for n, c in ctx.coords.items() if n != step.axis)
        for c in collectors:
            c._add(ctx.rank, self.rank, group, step.schedule, events)

    def _F(self, s: int, mb: int, peer) -> None:
        step, last = self.step, self.step.schedule.n_stages - 1
        x = None
        if s > 0:
            x = self.inputs.pop((s, mb)).detach().requires_grad_(True)  # (b, T, C)
            memory.watch(x, tier="device", kind="activation")
        # the stage's own top-level params only: a gathered (ZeRO-3) embedding or head then gathers,
        # and hands gradients to, exactly the leaves this stage's backward asks for
        own = {k: self.local[k] for k in step.plan.extras(s)}
        # saved tensors are booked as activations (detached: see cfx._src.remat.saved)
        with SavedTensors(self.param_storages, on_save=_watch_activation) if self.tracked else contextlib.nullcontext():
            h = step.parts.embed(own, self.tokens[mb]) if s == 0 else x  # (b, T, C)
            h, extra = self._blocks(s, h)
            if s == last and self.valid[mb] == 0:  # nothing to predict: a zero that still
                h = h.float().sum() * 0.0              # routes (zero) gradients back
            elif s == last:
                h = step.parts.head_loss(own, h, self.targets[mb]) * self.weights[mb]
            if s == last and extra is not None:
                h = h + extra
        if s == last:
            self.loss = self.loss + h.detach().float()
            if not self.forward_only:
                self.live[s, mb] = (h, x)
            return
        if extra is not None:  # the blocks' own terms: counted here, backpropagated with the output
            self.loss = self.loss + extra.detach().float()
            if not self.forward_only:
                h = _WithLoss.apply(h, extra, self.scale)
        if not self.forward_only:
            self.live[s, mb] = (get_gradient_edge(h), x)
        if step.schedule.stage_rank(s + 1) == self.rank:
            self.inputs[s + 1, mb] = h.detach()
        else:
            self.outputs[s, mb] = h.detach()

    def _blocks(self, s: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stage ``s``'s blocks on ``h`` (b, T, C), and with the parts' ``block_loss`` the sum of their
        terms as this microbatch's share of the whole batch's (1/m); None without."""
        step = self.step
        blocks = step.plan.blocks(s)
        if step.chain is not None:  # the stage's blocks as one checkpointed chain
            return step.chain.run([step.model.blocks[i].apply for i in blocks],
                                  [self.local["blocks"][i] for i in blocks], h,
                                  [dict(mask=None, key=None)] * len(blocks)), None
        if step.parts.block_loss is None:
            for i in blocks:
                h = step.model.blocks[i].apply(self.local["blocks"][i], h, mask=None, key=None)
            return h, None
        terms = []
        for i in blocks:
            h, term = step.parts.block_loss(step.model.blocks[i], self.local["blocks"][i], h)
            terms.append(term)
        return h, sum(terms[1:], terms[0]) / step.schedule.n_microbatches

    def _backward_inputs(self, s: int, mb: int) -> tuple:
        root, x = self.live.pop((s, mb))
        last = s == self.step.schedule.n_stages - 1
        if last:  # the backward's seed: d(loss * scale) / d(loss)
            grad = torch.ones_like(root) if self.scale is None else torch.ones_like(root) * self.scale
        else:
            grad = self.out_grads.pop((s, mb))
        return root, grad, x

    def _hand_back(self, s: int, mb: int, gx: torch.Tensor | None) -> None:
        if s == 0:
            return
        if self.step.schedule.stage_rank(s - 1) == self.rank:
            self.out_grads[s - 1, mb] = gx
        else:
            self.in_grads[s, mb] = gx

    def _B(self, s: int, mb: int, peer) -> None:
        root, grad, x = self._backward_inputs(s, mb)
        # into the leaves' .grad: autograd adds each gradient in place as it arrives, so a stage's
        # gradients for the next microbatch never sit beside the sum all at once
        inputs = ([x] if x is not None else []) + self.stage_leaves[s]
        torch.autograd.backward([root], [grad], inputs=inputs)
        gx = None if x is None else x.grad
        self._hand_back(s, mb, gx)

    def _I(self, s: int, mb: int, peer) -> None:
        root, grad, x = self._backward_inputs(s, mb)
        sb = self.split[s, mb] = SplitBackward(root, grad, x, self.stage_leaves[s])
        self._hand_back(s, mb, sb.input_grad())

    def _W(self, s: int, mb: int, peer) -> None:
        self.sums.add(self.stage_leaves[s], self.split.pop((s, mb)).weight_grads())

    def _send(self, t: torch.Tensor, family: int, s: int, mb: int, peer: int) -> None:
        want = self.messages.spec
        if tuple(t.shape) != want["shape"] or t.dtype != want["dtype"]:
            raise ValueError(f"{WHERE}: stage {s} produced a {t.dtype} tensor of shape "
                             f"{tuple(t.shape)} for rank {peer}, which expects {want['dtype']} "
                             f"{want['shape']} (microbatch, T, C in the params' dtype); keep "
                             f"blocks shape- and dtype-preserving.")
        self.messages.send(t, family, s, mb, peer)

    def _SEND_F(self, s: int, mb: int, peer: int) -> None:
        self._send(self.outputs.pop((s, mb)), 0, s, mb, peer)

    def _RECV_F(self, s: int, mb: int, peer: int) -> None:
        self.inputs[s + 1, mb] = self.messages.received("RECV_F", s, mb)

    def _SEND_B(self, s: int, mb: int, peer: int) -> None:
        self._send(self.in_grads.pop((s, mb)), 1, s, mb, peer)

    def _RECV_B(self, s: int, mb: int, peer: int) -> None:
        self.out_grads[s - 1, mb] = self.messages.received("RECV_B", s, mb)

    # -- results ----------------------------------------------------------------------------------
    def results(self) -> tuple[torch.Tensor, Any]:
        def held(tree):
            return tree_util.map(lambda t: self.sums.total(_grad_leaf(t)), tree)

        grads = {}
        for k, v in self.params.items():
            if k == "blocks" and self.step.local_blocks:
                grads[k] = [held(self.local["blocks"][i]) for i in self.step.held_blocks(self.rank)]
            elif k == "blocks":
                grads[k] = [held(self.local["blocks"][i]) if i in self.local["blocks"]
                            else tree_util.map(_zeros, b) for i, b in enumerate(v)]
            else:
                grads[k] = held(self.local[k]) if k in self.local else tree_util.map(_zeros, v)
        axis = self.step.axis
        if not self.step.sum_grads:
            return lax.psum(self.loss, axis), grads
        if self.step.local_blocks:  # each rank owns its blocks: only the rest is summed
            shared = {k: v for k, v in grads.items() if k != "blocks"}
            loss, shared = tree_psum((self.loss, shared), axis)
            return loss, {k: shared[k] if k != "blocks" else v for k, v in grads.items()}
        return tree_psum((self.loss, grads), axis)  # one flat all-reduce, the loss riding along


class WeightGrads:
    """The params' gradients W computes (a split backward's second half), summed over microbatches."""

    def __init__(self):
        self.acc: dict[int, torch.Tensor] = {}    # id(leaf) -> accumulated gradient
        self.owned: set[int] = set()              # the ids whose sum this run may add into

    def add(self, leaves: list, grads: list) -> None:
        """Add a backward's gradients of ``leaves`` into the sums: in place where the sum is a tensor
        nothing else holds (no second gradient of a microbatch alive beside the sum)."""
        shared = collections.Counter(g.untyped_storage()._cdata for g in grads if g is not None)
        for leaf, g in zip(leaves, grads):
            if g is None:
                continue
            k = id(leaf)
            if k not in self.acc:
                self.acc[k] = g
                if g._base is None and shared[g.untyped_storage()._cdata] == 1:
                    self.owned.add(k)  # a fresh tensor of its own: safe to add into
            elif k in self.owned:
                self.acc[k].add_(g)
            else:
                self.acc[k] = self.acc[k] + g
                self.owned.add(k)

    def total(self, leaf: torch.Tensor) -> torch.Tensor:
        """``leaf``'s whole gradient: what B added into its ``.grad``, and what W summed here."""
        g, w = leaf.grad, self.acc.get(id(leaf))
        if g is None:
            return w if w is not None else torch.zeros_like(leaf)
        return g if w is None else g + w


class _WithLoss(torch.autograd.Function):
    """A stage's output ``h`` unchanged, with a scalar ``loss`` of the stage's own riding on it into the
    backward: the gradient reaching ``h`` passes on, and ``loss`` gets the backward's seed (1, or the fp16
    loss scale), as if it were added to the pipeline's loss (Megatron-Core's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, loss: torch.Tensor, scale: Any) -> torch.Tensor:
        ctx.scale, ctx.like = scale, (loss.shape, loss.dtype, loss.device)
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        shape, dtype, device = ctx.like
        seed = torch.ones(shape, dtype=dtype, device=device)
        return grad, (seed if ctx.scale is None else (seed * ctx.scale).to(dtype)), None


def _watch_activation(t: torch.Tensor) -> None:
    if t.is_floating_point():
        memory.watch(t, tier="device", kind="activation")


def _leaves_of(tree: Any) -> Any:
    """``tree`` with every tensor a fresh leaf that requires grad (sharing storage); a ZeRO-3
    ``ShardedLeaf`` keeps its shape and gets a fresh piece (its gathered layer gathers it)."""
    def fresh(t):
        if isinstance(t, ShardedLeaf):
            return dataclasses.replace(t, piece=t.piece.detach().requires_grad_(True))
        return t.detach().requires_grad_(True)
    return tree_util.map(fresh, tree)


def _grad_leaf(x: Any) -> torch.Tensor:
    """The tensor a params leaf's gradient is taken with respect to (a ZeRO-3 leaf's piece)."""
    return x.piece if isinstance(x, ShardedLeaf) else x


def _zeros(x: Any) -> torch.Tensor:
    return torch.zeros_like(_grad_leaf(x))
