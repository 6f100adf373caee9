"""One stage's backward for one microbatch: whole (``B``) or split (``I`` now, ``W`` later).

The stage's forward left an autograd graph from its input ``x`` (a detached leaf, or None for
the first stage, whose input is tokens) and its parameters to a root: its output, kept only as
a ``GradientEdge`` so the output tensor itself can be freed once sent, or the scaled loss.

Zero-bubble split without recomputation. Call the *x-closure* the graph nodes that reach ``x``.
Every path from the root to a parameter leaves the x-closure exactly once, over an edge
``N -> M`` where N reaches x and M does not (e.g. a matmul node N whose weight input M is the
transposed parameter). So:

  I  runs ``torch.autograd.grad(root, x, retain_graph=True)`` - which executes exactly the
     x-closure - and captures, with a pre-hook, the full gradient flowing into each such N.
  W  runs each N again for its weight edges only (``inputs=`` the edges into M, so the input
     branch is skipped), then pushes those gradients from the M's down to the parameters.

W thus costs the weight half of the backward, not a second full backward. A stage without a
float input (stage 0) has an empty x-closure: I does nothing and W is its whole backward.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

Root = torch.Tensor | GradientEdge


def _add(acc: list, i: int, g: torch.Tensor | None) -> None:
    if g is not None:
        acc[i] = g if acc[i] is None else acc[i] + g


def full_backward(root: Root, grad: torch.Tensor, x: torch.Tensor | None,
                  params: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, list]:
    """``B``: (gradient of x or None, gradients of params with None where unused)."""
    inputs = ([x] if x is not None else []) + list(params)
    grads = torch.autograd.grad([root], inputs, [grad], allow_unused=True)
    return (grads[0], list(grads[1:])) if x is not None else (None, list(grads))


def _closure(root_node: Any, x_node: Any, param_nodes: set) -> dict:
    """Weight edges ``{N: [(M, input_nr), ...]}`` for the nodes N of the x-closure."""
    reach_x: dict = {}
    reach_p: dict = {}
    stack = [(root_node, False)]
    while stack:  # iterative post-order over next_functions
        node, expanded = stack.pop()
        if node in reach_x:
            continue
        kids = [c for c, _ in node.next_functions if c is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in kids if c not in reach_x)
            continue
        reach_x[node] = node is x_node or any(reach_x[c] for c in kids)
        reach_p[node] = node in param_nodes or any(reach_p[c] for c in kids)
    out = {}
    for node, rx in reach_x.items():
        if rx:
            edges = [(c, nr) for c, nr in node.next_functions
                     if c is not None and not reach_x[c] and reach_p[c]]
            if edges:
                out[node] = edges
    return out


class SplitBackward:
    """``I`` then ``W`` of one (stage, microbatch); see the module docstring."""

    def __init__(self, root: Root, grad: torch.Tensor, x: torch.Tensor | None,
                 params: Sequence[torch.Tensor]):
        self.root, self.grad, self.x, self.params = root, grad, x, list(params)
        self.captured: dict = {}   # N -> gradients flowing into N (its grad_outputs)
        self.edges: dict = {}      # N -> weight edges of N

    def input_grad(self) -> torch.Tensor | None:
        """``I``: the gradient of x (None for a stage without float input)."""
        if self.x is None:
            return None
        root_node = self.root.node if isinstance(self.root, GradientEdge) else self.root.grad_fn
        param_nodes = {get_gradient_edge(p).node for p in self.params}
        self.edges = _closure(root_node, get_gradient_edge(self.x).node, param_nodes)
        hooks = [n.register_prehook(lambda go, n=n: self.captured.__setitem__(n, go))
                 for n in self.edges]
        try:
            (gx,) = torch.autograd.grad([self.root], [self.x], [self.grad], retain_graph=True)
        finally:
            for h in hooks:
                h.remove()
        self.root = self.grad = self.x = None  # W needs only the captured nodes
        return gx

    def weight_grads(self) -> list[torch.Tensor | None]:
        """``W``: gradients of the params (None where unused); call once, after ``input_grad``."""
        if self.root is not None:  # no float input: W is the whole backward
            _, grads = full_backward(self.root, self.grad, None, self.params)
            self.root = self.grad = None
            return grads
        leaf_of = {get_gradient_edge(p).node: i for i, p in enumerate(self.params)}
        out: list = [None] * len(self.params)
        into: dict = {}  # (M, input_nr) -> gradient flowing into M there
        for node, edges in self.edges.items():
            go = self.captured[node]
            ks = [k for k, g in enumerate(go) if g is not None]
            if not ks:
                continue
            targets = [self.params[leaf_of[m]] if m in leaf_of else GradientEdge(m, nr)
                       for m, nr in edges]
            grads = torch.autograd.grad([GradientEdge(node, k) for k in ks], targets,
                                        [go[k] for k in ks], allow_unused=True)
            for e, g in zip(edges, grads):
                if g is not None:
                    into[e] = into[e] + g if e in into else g
        rest = []
        for (m, nr), g in into.items():
            if m in leaf_of:
                _add(out, leaf_of[m], g)
            else:
                rest.append((GradientEdge(m, nr), g))
        if rest:
            grads = torch.autograd.grad([e for e, _ in rest], self.params, [g for _, g in rest],
                                        allow_unused=True)
            for i, g in enumerate(grads):
                _add(out, i, g)
        self.captured, self.edges = {}, {}
        return out
