"""Lightning-indexer scores and the cpu backend's exact fast top-k (DSV4-REFERENCE §3.8).

The reference ranks compressed entries by fp64 scores. At long context that scoring is the one
part of prefill that grows with the context (every query scores all L / 4 entries), and fp32 runs
its GEMM twice as fast but rounds: measured, fp32 scores moved 0.1% of top-64 selections. So fp32
only screens here. The textbook bound on a floating-point dot product (any summation order, FMA
or not) bounds each fp32 score's error; per query it leaves a candidate set that provably holds
the whole fp64 top-k, and only those candidates are rescored in fp64 and ranked. A query whose
candidates overflow the set's width is scored in fp64 whole. The selection is the fp64 one (a set
in ascending entry id, `top_entries`); what is saved is fp64 work on entries that cannot be selected.
"""
from __future__ import annotations

import torch

# Entries per block of `index_scores`: a block's [n, Hi, block] tile fits L2 (4 MiB here),
# but never under 64 entries, where BLAS takes a slower small-matrix path (measured: 32 is 2x slower).
INDEX_TILE_BYTES = 1 << 22
INDEX_MIN_BLOCK = 64
FP32_UNIT_ROUNDOFF = 2.0 ** -24
# Screening pays off from this many queries (a prefill chunk; decode and verify stay on the fp64
# path, so decode never waits on a data-dependent branch) and entries per candidate slot (measured
# at 512 queries, 8 heads x 32, 88 slots: screened / fp64 time 1.04 at 768 entries, 0.96 at 896).
SCREEN_MIN_QUERIES = 32
SCREEN_MIN_ENTRIES_PER_SLOT = 10


def _block(rows: int, itemsize: int) -> int:
    """Entries per block: a [rows, block] tile of products fits INDEX_TILE_BYTES."""
    return max(INDEX_MIN_BLOCK, INDEX_TILE_BYTES // itemsize // max(1, rows))


def _visible(entry_ids: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Whether each query [n] sees entry ids ([E] shared or [n, C] per query): entry w is complete
    from position (w + 1) * ratio - 1 on."""
    return entry_ids < ((positions + 1) // ratio)[:, None]


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, *,
                 ratio: int, weight_scale: float) -> torch.Tensor:
    """Indexer scores of one sequence's queries [n, E] in fp64 (the reference); entries not yet
    complete are -inf.

    score(t, w) = sum_j weight_scale * weights[t, j] * ReLU(q[t, j] . keys[w]), visible iff
    w < (t + 1) / ratio. q [n, Hi, Di], weights [n, Hi], keys [E, Di], positions [n].
    """
    ws = (weights.double() * weight_scale).unsqueeze(1)                    # [n, 1, Hi]
    q, keys = q.double(), keys.double()
    scores = torch.empty(q.shape[0], keys.shape[0], dtype=torch.float64)    # [n, E]
    # The [n, Hi, E] ReLU'd products are the one tensor that grows with context (E = L / ratio).
    # Made whole, it streams through memory three times (product, ReLU, head contraction) and
    # made prefill superlinear; made one block of entries at a time it stays in cache (2.5-3x
    # faster at 8K-32K tokens, same values: each score is the same length-Di dot and length-Hi sum).
    block = _block(q.shape[0] * q.shape[1], itemsize=8)
    for lo in range(0, keys.shape[0], block):
        relu = torch.einsum("thd,ed->the", q, keys[lo:lo + block]).relu_()      # [n, Hi, block]
        scores[:, lo:lo + block] = torch.bmm(ws, relu).squeeze(1)
    return scores.masked_fill_(~_visible(torch.arange(keys.shape[0]), positions, ratio), float("-inf"))


def _width(topk: int, entries: int) -> int:
    """Candidates kept per query: the top-k and a quarter more, plus a few."""
    return min(entries, topk + topk // 4 + 8)


def worth_screening(queries: int, entries: int, topk: int) -> bool:
    """Shapes only. fp32 matmuls must really be fp32: a reduced-precision setting
    (torch.set_float32_matmul_precision "high" / "medium") voids the rounding bound."""
    return (queries >= SCREEN_MIN_QUERIES and entries >= SCREEN_MIN_ENTRIES_PER_SLOT * _width(topk, entries)
            and torch.get_float32_matmul_precision() == "highest")


def screen_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, *,
                  ratio: int, weight_scale: float) -> torch.Tensor:
    """fp32 scores [n, E] of the screen: `index_scores`' sums, in fp32 (error: `_error_bound`).

    Same products and sums as `index_scores`, written into one reused buffer per block by a plain
    mm: the fp32 screen streams [n * Hi, E] products, and einsum's temporaries cost a third more
    (measured at n = 512, Hi = 8, E = 8K: 20 vs 14 ms for the products alone)."""
    n, hi, di = q.shape
    rows = q.float().reshape(n * hi, di)                                    # [n * Hi, Di]
    ws = (weights.double() * weight_scale).float().unsqueeze(1)            # [n, 1, Hi]
    keys = keys.float()
    scores = torch.empty(n, keys.shape[0])                                  # [n, E]
    block = _block(n * hi, itemsize=4)
    buf = torch.empty(n * hi * block)
    for lo in range(0, keys.shape[0], block):
        part = keys[lo:lo + block]
        prod = torch.mm(rows, part.T, out=buf[: n * hi * part.shape[0]].view(n * hi, part.shape[0]))
        scores[:, lo:lo + part.shape[0]] = torch.bmm(ws, prod.relu_().view(n, hi, -1)).squeeze(1)
    return scores.masked_fill_(~_visible(torch.arange(keys.shape[0]), positions, ratio), float("-inf"))


def top_width(scores: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` largest values of each row of scores [n, E] (descending) and entries holding
    them, like torch.topk but in two levels when rows are long.

    One topk over E entries costs 5-6 ns per entry (23 ms at n = 512, E = 8K, width 88). Here the
    entries fall in S strided groups of G (entry e in group e mod S), a topk over the S group maxima
    picks `width` groups, and a topk over their G * width entries the values: 16-20 ms there. The
    values are exactly torch.topk's: an entry of the true top `width` left in an unpicked group
    would need every picked group's maximum at least as large, `width` entries that large in
    picked groups already. Which of equal entries is returned is the implementation's choice, as
    in torch.topk."""
    n, entries = scores.shape
    groups = max(1, round((entries / width) ** 0.5))                        # G ~ sqrt(E / width)
    stride = -(-entries // groups)                                          # S
    if groups < 4 or stride < width:
        return scores.topk(width, dim=-1)
    padded = scores.new_full((n, groups * stride), float("-inf"))
    padded[:, :entries] = scores
    best = padded.view(n, groups, stride).amax(1).topk(width, dim=-1).indices             # [n, width]
    members = (best[:, None, :] + torch.arange(groups)[:, None] * stride).reshape(n, -1)  # [n, G * width]
    top = torch.gather(padded, 1, members).topk(width, dim=-1)
    # A padding slot (id >= E) is picked only in a row with fewer than `width` finite scores, and
    # there only as one of its -inf values; entry E - 1 is -inf in such a row too (a row seeing the
    # last entry sees all E >= width), so it stands in for the padding and every id is a real entry.
    return top.values, torch.gather(members, 1, top.indices).clamp_(max=entries - 1)


def _error_bound(q: torch.Tensor, ws: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per query, a bound [n] on |fp32 score - exact score| over all of its entries.

    A length-m dot product in fp32 is off by at most gamma_m * sum|x_i y_i| (gamma_m ~ m * u), and
    sum|x_i y_i| <= |x| |y|. ReLU does not enlarge an error; the Hi-term head sum adds gamma_Hi of
    the same magnitude; rounding ws (and q, keys if not fp32 already) adds a few u. So with
    A_t = sum_j |ws_tj| |q_tj|: |error| <= (Di + Hi + 4) u A_t |k| to first order. The factor 2
    covers the second-order terms and the fp64 reference's own rounding many times over."""
    hi, di = q.shape[1], q.shape[2]
    a = (ws.abs() * q.double().norm(dim=-1)).sum(-1)                       # [n]
    return 2 * (di + hi + 4) * FP32_UNIT_ROUNDOFF * a * keys.double().norm(dim=-1).max()


def _fp64_scores(q: torch.Tensor, ws: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fp64 scores [n, C] of each query's own entries ids [n, C] (no visibility mask)."""
    picked = keys.double()[ids]                                             # [n, C, Di]
    dots = torch.bmm(q.double(), picked.transpose(1, 2)).relu_()            # [n, Hi, C]
    return torch.bmm(ws.unsqueeze(1), dots).squeeze(1)                      # [n, C]


def top_entries(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best entries of each row of scores [n, E] as a set -> (ids [n, k] in ascending entry id,
    visible [n, k]); at a tie on the k-th score the lower entry ids are taken.

    torch.topk leaves ties to its implementation, and ties are real here: a score is exactly 0
    wherever ReLU zeroes every head, and a query with few positive scores reaches into them.
    Which ones it takes must not depend on the path (screened or not), and the order must not
    either, since attention sums over the selection in its order. Fixed shapes, no host sync."""
    n, entries = scores.shape
    kth = scores.topk(k, dim=-1).values[:, -1:]                              # [n, 1]
    above, tied = scores > kth, scores == kth                                # [n, E]
    chosen = above | (tied & (tied.cumsum(1) <= k - above.sum(1, keepdim=True)))   # k per row
    slot = torch.where(chosen, chosen.cumsum(1) - 1, k)                      # unchosen -> a spare column
    ids = torch.full((n, k + 1), -1, dtype=torch.int64)
    ids = ids.scatter_(1, slot, torch.arange(entries).expand(n, entries))[:, :k]
    return ids, torch.isfinite(torch.gather(scores, 1, ids))


def screened_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, *,
                  topk: int, ratio: int, weight_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What `top_entries` gives on the fp64 `index_scores` (ids [n, k'] ascending, visible [n, k'],
    k' = min(topk, E)), without fp64 work on the entries that cannot be selected."""
    k, width = min(topk, keys.shape[0]), _width(topk, keys.shape[0])
    ws = weights.double() * weight_scale                                    # [n, Hi]
    values, indices = top_width(screen_scores(q, weights, keys, positions, ratio=ratio, weight_scale=weight_scale),
                                width)                                      # [n, width], descending
    margin = _error_bound(q, ws, keys)                                      # [n]
    last, kth = values[:, -1].double(), values[:, k - 1].double()
    # An entry left out scores at most last + margin in fp64; k candidates score at least
    # kth - margin. When the first is below the second, nothing left out can reach (or tie) the
    # top-k. A row whose width-th fp32 score is -inf holds every visible entry already.
    fits = (last < kth - 2 * margin) | torch.isneginf(last)
    candidates = indices.sort(dim=-1).values                                # [n, width], ascending ids
    visible = _visible(candidates, positions, ratio)
    exact = _fp64_scores(q, ws, keys, candidates).masked_fill_(~visible, float("-inf"))
    picked, visible = top_entries(exact, k)
    ids = torch.gather(candidates, 1, picked)                               # ascending: candidates are
    if not bool(fits.all()):                                                # rare: a crowded boundary
        rows = (~fits).nonzero().squeeze(1)
        ids[rows], visible[rows] = top_entries(index_scores(q[rows], weights[rows], keys, positions[rows],
                                                            ratio=ratio, weight_scale=weight_scale), k)
    return ids, visible
