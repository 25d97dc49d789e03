"""A proposal as a token tree, and exact acceptance over it (SpecInfer's multi-draft recursive
rejection sampling; the seeds' notes `003_…`, "iterative speculative sampling").

Terms, for one request in one round:
- root: the request's last emitted token; node i (0..n-1) a proposed token `tokens[i]` whose
  parent is `parents[i]` (-1: the root). Parents come before their children, so a chain is the
  tree whose node i has parent i - 1; siblings are tried in their order.
- depth(i): 1 for the root's children. A verify pass feeds the root and the n nodes, node i at
  position (the root's) + depth(i), attending to the context, the root and its own ancestors.
- p[0]: the target's distribution after the root; p[i + 1]: after node i.
- q (a drawn tree's): q[0] the distribution the root's children were drawn from, q[i + 1] node
  i's children's. A node's children are draws without replacement in sibling order, so child c's
  proposal q_c is that q with the earlier siblings' tokens taken out, renormalised. A tree without
  q has chosen children (top-k, n-gram branches): each child's q_c is a point mass on its token.
- accepting: from the root down, the children of the current node are tried in order against r,
  the node's p with every rejected sibling's q_c taken out: child c is accepted with probability
  min(1, r(x_c) / q_c(x_c)), else r <- norm(max(0, r - q_c)). The first accepted child becomes the
  current node. The walk ends at a leaf (the bonus token, drawn from its p) or when every child is
  rejected (the recovered token, drawn from r). Each step is recursive rejection sampling of one
  token with a proposal per sibling (exact for draws without replacement: a sibling is drawn from
  q_c given the ones before it), so every emitted token follows the target exactly.
- greedy: follow the child whose token is the target's argmax; the final token is the argmax
  where no child matches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from engine.kv.tree_view import unpack_bits


@dataclass(frozen=True)
class TokenTree:
    tokens: tuple[int, ...]  # node i's token
    parents: tuple[int, ...]  # node i's parent (-1: the root); parents[i] < i
    # [n + 1, V] on the host: what the root's (row 0) and each node's (row i + 1) children were drawn
    # from; None: chosen children. With q_rows, only the rows of nodes with children: [m, V]
    q: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # where row i of that [n + 1, V] table is in q (-1: a leaf's, never read); None: q holds every row
    q_rows: tuple[int, ...] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a token tree needs a parent per token: {len(self.tokens)} tokens, "
                             f"{len(self.parents)} parents")
        rows = len(self.tokens) + 1
        if self.q is not None and self.q.dim() != 2:
            raise ValueError(f"a drawn tree's q must be [rows, V], got shape {tuple(self.q.shape)}")
        if self.q is not None and self.q_rows is None and self.q.shape[0] != rows:
            raise ValueError(f"a drawn tree's q needs a row per node and one for the root: {len(self.tokens)} "
                             f"nodes, q of shape {tuple(self.q.shape)}")
        if self.q_rows is not None and (self.q is None or len(self.q_rows) != rows
                                        or not all(-1 <= r < self.q.shape[0] for r in self.q_rows)):
            raise ValueError(f"q_rows needs q and an entry in [-1, {0 if self.q is None else self.q.shape[0]}) for "
                             f"the root and each of the {len(self.tokens)} nodes, got {self.q_rows}")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}'s parent must be -1 (the root) or an earlier node, got {parent}")

    @classmethod
    def chain(cls, tokens: list[int]) -> TokenTree:
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Node i's depth (1: a child of the root)."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return tuple(out)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[0]: the root's children; children[i + 1]: node i's; each in sibling order."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            out[parent + 1].append(i)
        return tuple(tuple(c) for c in out)

    def children_q(self, row: int) -> torch.Tensor | None:
        """[V] what the root's (row 0) or node row - 1's children were drawn from; None: chosen."""
        if self.q is None:
            return None
        at = self.q_row_of(row)
        return self.q[at] if at >= 0 else None

    def q_row_of(self, row: int) -> int:
        """Where row `row` of the [n + 1, V] table is in q (-1: nowhere)."""
        return row if self.q_rows is None else self.q_rows[row]

    @property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node` (empty for the root, -1)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    @cached_property
    def ancestor_bits(self) -> tuple[int, ...]:
        """ancestor_mask's rows as integers: bit b of row a set where row a may attend to column b."""
        out = [1]  # the root sees itself
        for i, parent in enumerate(self.parents):
            out.append(out[parent + 1] | 1 << (i + 1))
        return tuple(out)

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """[n + 1, n + 1] bool over (root, nodes): row a may attend to column b, b being a or one of
        a's ancestors (the root is everyone's)."""
        mask = unpack_bits(list(self.ancestor_bits), len(self) + 1).bool()
        return mask.to(device) if device is not None else mask



def accept_greedy(tree: TokenTree, target_argmax: list[int]) -> tuple[list[int], int]:
    """target_argmax: the argmax of p[0..n] -> (the accepted nodes, root to last; the final token)."""
    node, path = -1, []
    while True:
        best = target_argmax[node + 1]
        nxt = next((c for c in tree.children[node + 1] if tree.tokens[c] == best), None)
        if nxt is None:
            return path, best
        path.append(nxt)
        node = nxt


def accept_sampled(tree: TokenTree, p: torch.Tensor, uniforms: list[float]) -> tuple[list[int], torch.Tensor]:
    """p [n + 1, V] (root, then each node), uniforms: n + 1 draws in [0, 1) (one per child tried,
    in order; the rest unused) -> (the accepted nodes, root to last; the distribution [V] the final
    token is drawn from). The children's proposals come from tree.q (None: point masses)."""
    node, path, used = -1, [], 0
    residual = p[0]
    while True:
        kids = tree.children[node + 1]
        if not kids:
            return path, residual  # a leaf: the bonus token from its p (no sibling tried)
        accepted = None
        proposal = tree.children_q(node + 1)  # [V] or None; tried siblings go below
        proposal = None if proposal is None else proposal.to(residual.dtype)
        for c in kids:
            x = tree.tokens[c]
            q_c = None if proposal is None else proposal / proposal.sum()
            q_x = float(q_c[x]) if q_c is not None else 1.0
            ratio = min(1.0, float(residual[x]) / q_x) if q_x > 0 else 0.0
            hit = uniforms[used] < ratio
            used += 1
            if hit:
                accepted = c
                break
            if q_c is None:
                left = residual.clone()
                left[x] = 0.0
            else:
                left = (residual - q_c).clamp_min(0)
                proposal = proposal.clone()
                proposal[x] = 0.0
            mass = float(left.sum())
            # no mass left only through rounding, when r equalled q: r itself is then exact
            residual = left / mass if mass > 0 else residual
        if accepted is None:
            return path, residual
        path.append(accepted)
        node = accepted
        residual = p[node + 1]
