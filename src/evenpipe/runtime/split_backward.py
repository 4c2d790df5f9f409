"""Split backward for zero-bubble schedules: input gradients now (``I``), weight gradients later (``W``).

Vocabulary. In the backward graph of a stage, the *input path* is the set of nodes from which the stage input's
gradient node is reachable; :func:`backward_input` runs only those. A *split node* is an input-path node with an
edge into a subgraph that reaches parameters but not the input (a matmul's weight operand, a layer norm's
weight); a *param group* is a set of parameters whose subgraphs share split nodes. During ``I`` a pre-hook on
each split node keeps the gradient arriving at it; during ``W`` one engine call per param group runs, from those
kept gradients, only the nodes that lead to the group's parameters (for a linear layer: just ``x^T @ dy``), and
accumulates into ``.grad`` exactly as a full backward would.

Edge cases. With no input that requires grad, ``I`` does nothing and ``W`` is the whole backward. A group whose
parameters are also reachable from its split nodes through the input path (a weight used twice along the chain)
could be counted twice by a restarted engine call, so its parameters are computed during ``I`` instead and only
accumulated during ``W``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.autograd import Variable
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightState", "backward_input", "backward_weight", "run_backward"]


@dataclass(kw_only=True, slots=True)
class WeightState:
    """What ``I`` leaves for ``W``: the captured gradients at split nodes, per param group."""

    groups: list[tuple[list[Node], list[torch.Tensor]]] = field(default_factory=list)
    """Per param group: its split nodes and the parameters they lead to."""
    captured: dict[Node, tuple[Any, ...]] = field(default_factory=dict)
    """Gradient arriving at each split node during ``I`` (one entry per node input slot, ``None`` if none)."""
    early: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    """Parameter gradients already computed during ``I`` (conflicting groups), accumulated during ``W``."""
    roots: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None
    """Outputs and their gradients when ``I`` ran nothing (no input needs a gradient): ``W`` is a full backward."""


def run_backward(roots: Sequence[Any], grads: Sequence[Any], *, keep_graph: bool, inputs: Sequence[Any] = (),
                 accumulate: bool = True) -> tuple[torch.Tensor, ...]:
    """The autograd engine without ``torch.autograd.backward``'s output/grad shape check (stage outputs may have
    freed storage): gradients of ``inputs`` (accumulated into ``.grad`` when ``accumulate``, else returned)."""
    return Variable._execution_engine.run_backward(  # type: ignore[attr-defined,no-any-return]
        tuple(roots), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate)


def _node(t: torch.Tensor) -> Node:
    return get_gradient_edge(t).node


def _children(n: Node) -> list[Node]:
    return [c for c, _ in n.next_functions if c is not None]


def _reach_masks(roots: Sequence[Node], bits: dict[Node, int]) -> dict[Node, int]:
    """For every node reachable from ``roots``: the OR of ``bits`` over the nodes reachable from it (itself
    included), in one post-order pass over the graph (each node and edge visited once)."""
    mask: dict[Node, int] = {}
    for start in roots:
        if start in mask:
            continue
        stack: list[tuple[Node, bool]] = [(start, False)]
        while stack:
            n, expanded = stack.pop()
            if expanded:
                m = bits.get(n, 0)
                for c in _children(n):
                    m |= mask.get(c, 0)
                mask[n] = m
                continue
            if n in mask:
                continue
            stack.append((n, True))
            stack.extend((c, False) for c in _children(n) if c not in mask)
    return mask


def _param_groups(split_of: dict[Node, list[Node]], params_of: dict[Node, torch.Tensor]
                  ) -> list[tuple[list[Node], list[Node]]]:
    """Union of (split node -> param nodes it leads to) into groups sharing split nodes or params."""
    parent: dict[Node, Node] = {}

    def find(n: Node) -> Node:
        while parent.setdefault(n, n) is not n:
            n = parent[n]
        return n
    for s, ps in split_of.items():
        for p in ps:
            parent[find(p)] = find(s)
    groups: dict[Node, tuple[list[Node], list[Node]]] = {}
    for s in split_of:
        groups.setdefault(find(s), ([], []))[0].append(s)
    for p in params_of:
        if p in parent:
            groups.setdefault(find(p), ([], []))[1].append(p)
    return list(groups.values())


def backward_input(outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
                   ) -> tuple[tuple[torch.Tensor | None, ...], WeightState]:
    """``I``: gradients of ``inputs`` from ``outputs`` seeded with ``grad_outputs``; keeps the graph for ``W``.

    Returns the input gradients (``None`` for an input that does not require grad) and the state
    :func:`backward_weight` needs. Parameter ``.grad`` is not touched here.
    """
    need = [x for x in inputs if x.requires_grad]
    if not need:
        return tuple(None for _ in inputs), WeightState(roots=(tuple(outputs), tuple(grad_outputs)))
    root_nodes = [n for n in (o.grad_fn for o in outputs) if n is not None]
    params_of = {_node(p): p for p in params if p.requires_grad}
    # bit 0: the input path (reaches an input's gradient node); bit k+1: reaches parameter k's node
    param_nodes = list(params_of)
    bit_of = {pn: 2 << k for k, pn in enumerate(param_nodes)}
    bits: dict[Node, int] = {}
    for x in need:
        bits[_node(x)] = bits.get(_node(x), 0) | 1
    for pn, bit in bit_of.items():
        bits[pn] = bits.get(pn, 0) | bit
    mask = _reach_masks(root_nodes, bits)
    split_of: dict[Node, list[Node]] = {}
    for n, m in mask.items():
        if m & 1:
            reach = 0
            for c in _children(n):
                mc = mask.get(c, 0)
                if not mc & 1:
                    reach |= mc
            if reach:
                split_of[n] = [pn for k, pn in enumerate(param_nodes) if reach >> (k + 1) & 1]
    state = WeightState()
    early: list[Node] = []
    for splits, pnodes in _param_groups(split_of, params_of):
        group_bits = sum(bit_of[p] for p in pnodes)
        via_path = any(mask.get(c, 0) & group_bits for s in splits for c in _children(s) if mask.get(c, 0) & 1)
        if via_path:
            early.extend(pnodes)
        else:
            state.groups.append((splits, [params_of[p] for p in pnodes]))
    handles = []
    for splits, _ in state.groups:
        for s in splits:
            def keep(grads: tuple[Any, ...], s: Node = s) -> None:
                state.captured[s] = tuple(grads)
            handles.append(s.register_prehook(keep))
    early_params = [params_of[p] for p in early]
    try:
        got = run_backward(outputs, grad_outputs, inputs=[*need, *early_params], keep_graph=True, accumulate=False)
    finally:
        for h in handles:
            h.remove()
    state.early = list(zip(early_params, got[len(need):]))
    it = iter(got[:len(need)])
    return tuple(next(it) if x.requires_grad else None for x in inputs), state


def _accumulate(p: torch.Tensor, g: torch.Tensor | None) -> None:
    if g is None:
        return
    if p.grad is None:  # a copy laid out like the parameter: ``g`` may alias a gradient sent on elsewhere
        p.grad = torch.empty_like(p).copy_(g.detach())
    else:
        p.grad += g


def backward_weight(state: WeightState, params: Sequence[torch.Tensor]) -> None:
    """``W``: accumulate the parameter gradients into ``.grad`` and free the graph kept by ``I``.

    ``params`` are the stage parameters (those that require grad); with no input path (first stage) this is a
    full backward into them.
    """
    if state.roots is not None:
        outs, grads = state.roots
        want = [p for p in params if p.requires_grad]
        if want:
            run_backward(outs, grads, inputs=want, keep_graph=False, accumulate=True)
        state.roots = None
        return
    for p, g in state.early:
        _accumulate(p, g)
    for splits, group_params in state.groups:
        edges, seeds = [], []
        for s in splits:
            for slot, g in enumerate(state.captured.get(s, ())):
                if g is not None:
                    edges.append(GradientEdge(s, slot))
                    seeds.append(g)
        if not edges:
            continue
        # groups share no split node, so each graph part runs at most once: free it as we go
        got = run_backward(edges, seeds, inputs=[get_gradient_edge(p) for p in group_params], keep_graph=False,
                           accumulate=False)
        for p, g in zip(group_params, got):
            _accumulate(p, g)
    state.groups.clear()
    state.captured.clear()
    state.early.clear()
