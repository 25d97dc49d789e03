"""A proposal as a token tree, and the bit packing of its ancestor mask (the engine's bottom floor:
kv/, model/, grammar and speculative/ read it; its exact acceptance is speculative/verify/tree.py).

Terms, for one request in one round:
- root: the request's last emitted token; node i (0..n-1) a proposed token `tokens[i]` whose
  parent is `parents[i]` (-1: the root). Parents come before their children, so a chain is the
  tree whose node i has parent i - 1; siblings are tried in their order.
- depth(i): 1 for the root's children. A verify pass feeds the root and the n nodes, node i at
  position (the root's) + depth(i), attending to the context, the root and its own ancestors.
- q (a drawn tree's): q[0] the distribution the root's children were drawn from, q[i + 1] node
  i's children's; None: chosen children (top-k, n-gram branches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


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


def unpack_bits(rows: list[int], columns: int) -> torch.Tensor:
    """[len(rows), columns] uint8 on the host: bit j of rows[i] at [i, j] (one pass over bytes, not
    an op per bit)."""
    width = (columns + 7) // 8
    packed = torch.frombuffer(bytearray(b"".join(r.to_bytes(width, "little") for r in rows)), dtype=torch.uint8)
    bits = packed.view(len(rows), width, 1) >> torch.arange(8, dtype=torch.uint8) & 1  # [rows, width, 8]
    return bits.view(len(rows), 8 * width)[:, :columns]
