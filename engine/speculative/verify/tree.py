"""Exact acceptance over token trees (engine/token_tree.py; the pass: kv/tree_view.py): which
batches may take trees, and a batch's trees accepted from one verify pass, by SpecInfer's
multi-draft recursive rejection sampling (the seeds' notes `003_…`, "iterative speculative
sampling").

Terms, for one request in one round (a tree's root, nodes, depths and q as in token_tree.py):
- p[0]: the target's distribution after the root; p[i + 1]: after node i.
- A node's children are draws without replacement in sibling order, so child c's proposal q_c is
  its parent's q with the earlier siblings' tokens taken out, renormalised; a tree without q has
  chosen children: each child's q_c is a point mass on its token.
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

import torch

from engine import host_sync
from engine.grammar import cut_tree
from engine.logprobs import log_distribution, most_wanted, row_logprob, table
from engine.request import Request
from engine.sampling import SamplingRows, adjusted_probs, inverse_cdf
from engine.token_tree import TokenTree
from engine.uniforms import draw_uniforms

NO_TREE = TokenTree((), ())


def takes_trees(reqs: list[Request]) -> bool:
    """Trees for this batch: no penalty or logit bias (each node's distribution would depend on its
    own path); otherwise the round is a chain. Grammars apply at every node (`grammar_masks`);
    logprobs come from the positions of the emitted tokens (`tree_logprobs`)."""
    return all(not r.params.adjusts_logits for r in reqs)


def tree_logprobs(reqs: list[Request], trees: list[TokenTree | None], paths: list[list[int]], finals: list[int],
                  logits: torch.Tensor, raw_logits: torch.Tensor, logprobs_mode: str) -> None:
    """Each request that asks for logprobs gets those of its emitted tokens (the accepted nodes,
    then the final token) in pending_logprobs, from the target's distribution at the root and at
    each accepted node: raw_logits [N, T, V] before grammar masks ("raw"), or the distribution
    sampled from ("processed": logits [N, T, V] masked, temperature and filters applied)."""
    k = most_wanted([r.params.logprobs for r in reqs])
    if k is None:
        return
    n, T, V = logits.shape
    wanted = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    at = [i * T + pos for i in wanted for pos in [0] + [node + 1 for node in paths[i]]]  # emitted positions
    index = host_sync.upload(at, logits.device, torch.long)  # [M]
    probs = None
    if logprobs_mode == "processed":
        rows = SamplingRows.build([reqs[i].params for i in wanted], logits.device)
        rows = rows.repeat_rows(host_sync.upload([len(paths[i]) + 1 for i in wanted], logits.device, torch.long))
        probs = adjusted_probs(logits.reshape(n * T, V).index_select(0, index), rows, None)  # [M, V]
    emitted = [t for i in wanted for t in [trees[i].tokens[j] for j in paths[i]] + [finals[i]]]
    lp = log_distribution(raw_logits.reshape(n * T, V).index_select(0, index), probs, logprobs_mode)  # [M, V]
    values = host_sync.read(table(lp, host_sync.upload(emitted, logits.device, torch.long), k))  # [M, 2 + 2k]
    first = 0
    for i in wanted:
        r, count = reqs[i], len(paths[i]) + 1
        r.pending_logprobs = [row_logprob(v, k, r.params.logprobs) for v in values[first:first + count]]
        first += count


def grammar_masks(reqs: list[Request], trees: list[TokenTree | None], vocab_size: int
                  ) -> tuple[list[TokenTree | None], torch.Tensor | None]:
    """Each constrained row's tree cut where its grammar forbids a node, and the verify pass's
    masks [N, T, V] (T: the widest row's root and nodes; True on unconstrained rows), or None
    where no row has a grammar."""
    if all(r.grammar is None for r in reqs):
        return trees, None
    cut: list[TokenTree | None] = []
    row_masks: list[torch.Tensor | None] = []
    for r, t in zip(reqs, trees):
        if r.grammar is None:
            cut.append(t)
            row_masks.append(None)
            continue
        pruned, masks = cut_tree(r.grammar, t if t is not None else NO_TREE, vocab_size)  # masks [n + 1, V]
        cut.append(pruned if len(pruned) else (None if t is None else pruned))
        row_masks.append(masks)
    width = max(len(t) + 1 if t is not None else 1 for t in cut)
    out = torch.ones(len(reqs), width, vocab_size, dtype=torch.bool)  # [N, T, V]
    for i, m in enumerate(row_masks):
        if m is not None:
            out[i, :m.shape[0]] = m
    return cut, out


def accept_trees(reqs: list[Request], trees: list[TokenTree | None], logits: torch.Tensor
                 ) -> tuple[list[list[int]], list[int]]:
    """logits [N, T, V] of a tree pass (row i: root, then its nodes) -> (each row's accepted
    nodes, root to last; its final token). A row without a tree emits one token, as plain
    decoding. A row with n nodes takes n + 1 draws from its random stream."""
    trees = [t if t is not None else NO_TREE for t in trees]
    n, T, V = logits.shape
    params = [r.params for r in reqs]
    if all(p.greedy for p in params):
        argmax = host_sync.read(logits.argmax(dim=-1))  # [N, T]
        out = [accept_greedy(t, row) for t, row in zip(trees, argmax)]
        return [o[0] for o in out], [o[1] for o in out]
    rows = SamplingRows.build(params, logits.device)
    p = adjusted_probs(logits.reshape(n * T, V), rows.repeat_rows(T), None).reshape(n, T, V)  # [N, T, V]
    uniforms = draw_uniforms([r.random_stream for r in reqs], T, logits.device,
                             counts=[len(t) + 1 for t in trees])  # [N, T]
    wanted = [i * T + j for i, t in enumerate(trees) for j in range(len(t) + 1)]  # each row's root and nodes
    p_host = host_sync.fetch(p.reshape(n * T, V).index_select(0, host_sync.upload(wanted, p.device, torch.long)))
    u_host = host_sync.read(uniforms)  # [N][T]
    paths, finals, first = [], [], 0
    for t, u_row in zip(trees, u_host):
        path, final = accept_sampled(t, p_host[first:first + len(t) + 1].double(), u_row)
        first += len(t) + 1
        paths.append(path)
        finals.append(final)
    picks = inverse_cdf(torch.stack(finals), torch.tensor([u[len(t)] for t, u in zip(trees, u_host)],
                                                          dtype=torch.float64))  # [N]
    return paths, picks.tolist()


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
