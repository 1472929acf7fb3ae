"""The DSpark drafter trained on the finished target with DSpark's objective (DSV4-REFERENCE §5.3, paper §3.3).

The target is frozen, and so are the embedding and head the drafter shares with it. For every reply position of a
batch of conversations, the drafter sees what it sees when serving: ring rows kappa_s(main_x) of the last W
committed positions (from the target's own main_hidden), and a block [anchor, noise x (gamma - 1)] after them. Block
position k learns the target's distribution p_t for the token after the anchor's k-th successor, the Markov head
teacher-forced on the target's greedy tokens (the tokens an accepted prefix holds), with the loss
0.1 CE + 0.9 TV + BCE(confidence, 1 - TV), TV = 1/2 |p_d - p_t|_1, position k weighted exp(-k / gamma). CE is taken
against the target's greedy token: at temperature 0 a draft is accepted exactly when it is that token.

Rings are built here as tensors (out of place, so the gradient reaches main_proj and every stage's wkv) and the
draft block runs through the reference backend's generated `draft` program, addressed as the engine addresses it.
Must not know the task mix or the checkpoint format.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from lib.records.batch import Batch
from lib.records.decode_state import LayerPools
from lib.runtime.paged_cache import PagedCache, ring_addressing
from lib.training.corpus import Sequence
from lib.training.data_parallel import Share, take
from lib.training.target import prefill, shared_prefixes

CE_WEIGHT, TV_WEIGHT, BCE_WEIGHT = 0.1, 0.9, 1.0


def drafter_leaves(model) -> list[torch.Tensor]:
    leaves = []
    for block in model.params.drafter:
        for value in block.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                leaves.append(value.requires_grad_(True))
    return leaves


def anchors_of(seqs: list[Sequence]) -> list[tuple[int, int]]:
    """(conversation, p) for every committed position p whose next token (the anchor, at p + 1) is a reply token
    with at least one token after it: the blocks a served request drafts."""
    return [(c, p) for c, s in enumerate(seqs) for p in range(s.reply_start - 1, len(s.ids) - 2)]


class Blocks(NamedTuple):
    """The drafter's blocks at every reply anchor of a batch, teacher-forced on the target's greedy tokens."""
    anchors: list[tuple[int, int]]   # (conversation, p)
    logits: torch.Tensor             # [n, gamma, V] the draft logits l_k (Markov head included)
    confidence: torch.Tensor         # [n, gamma] confidence logits c_k
    target: torch.Tensor             # [n, gamma, V] the target's distribution for the same tokens
    greedy: torch.Tensor             # [n, gamma] the target's greedy tokens
    valid: torch.Tensor              # [n, gamma] the predicted token lies inside the conversation


def ring_rows(model) -> int:
    """Rows of a drafter stage's context ring, as the engine's cache sizes them."""
    return PagedCache.for_lengths(model, [1], rings=True).rings[0].window.shape[1]


def draft_blocks(model, seqs: list[Sequence], ring: int | None = None) -> Blocks:
    """Every reply anchor's draft block, as the engine would draft it after committing positions up to p
    (`ring`: ring_rows(model), computed once by a caller that drafts often)."""
    cfg, mod, params = model.cfg, model.module, model.params
    gamma, noise = cfg.dspark_block_size, cfg.dspark_noise_token_id
    with torch.no_grad():                      # the frozen target: its logits [T, V] and main_hidden [T, k*d]
        logits_t, hidden = prefill(model, seqs)
    logits_t = logits_t.double()
    offsets = torch.tensor([0] + [len(s.ids) for s in seqs]).cumsum(0)
    positions = torch.cat([torch.arange(len(s.ids)) for s in seqs])
    main_x = mod.draft_context(params, hidden, cfg, model.rope)
    anchors = anchors_of(seqs)
    n = len(anchors)
    ring = ring or ring_rows(model)
    conv = torch.tensor([c for c, _ in anchors])                                               # [n]
    committed = torch.tensor([p for _, p in anchors])                                          # [n] p
    # ring rows: anchor s holds positions q in [p + 1 - W, p + 1) of its conversation, in slot s at row q % W
    q = committed[:, None] - torch.arange(ring)                                                # [n, W]
    held = q >= 0
    dest = (torch.arange(n)[:, None] * ring + q % ring)[held]
    src = (offsets[conv][:, None] + q)[held]
    everywhere = Batch(torch.zeros_like(positions), positions, (len(positions),), (0,))
    rings = []
    for layer, lp in zip(model.stages, params.drafter):
        rows = mod.ring_entry(lp, main_x, everywhere, layer, cfg, model.rope)                 # [T, D]
        pool = torch.zeros((n + 1) * ring, rows.shape[-1], dtype=rows.dtype).index_copy(0, dest, rows[src])
        rings.append(LayerPools(pool.view(n + 1, ring, -1), None, None))
    anchor_rows = offsets[conv] + committed + 1                                                # the anchors' rows
    ids = torch.tensor([t for s in seqs for t in s.ids])                                       # [T]
    tokens = torch.cat((ids[anchor_rows][:, None], torch.full((n, gamma - 1), noise)), dim=1).view(-1)  # [n * gamma]
    block_pos = (committed + 1)[:, None] + torch.arange(gamma)
    starts = (committed + 1).tolist()                                                          # each block's first position
    batch = Batch(tokens, block_pos.view(-1), (gamma,) * n, tuple(starts))
    batch = batch._replace(state=ring_addressing(batch.seq_lens, list(range(n)), starts, n,
                                                 model.facts.block_tokens, model.facts.logical_block_tokens))
    base, y = mod.draft(params, batch, tuple(rings), cfg, model.rope)
    base, y = base.double().view(n, gamma, -1), y.double().view(n, gamma, -1)
    # the target at the rows that predict each block position's token: anchor row + k
    rows = anchor_rows[:, None] + torch.arange(gamma)                                        # [n, gamma]
    ends = offsets[conv + 1] - 1                                                               # [n] last rows
    valid = rows < ends[:, None]                                     # the predicted token lies in the conversation
    p_t = torch.softmax(logits_t[rows.clamp(max=logits_t.shape[0] - 1)], dim=-1)             # [n, gamma, V]
    greedy = p_t.argmax(-1)                                                                     # [n, gamma]
    last = params.drafter[-1]
    w1, w2 = last["markov_head.markov_w1.weight"].double(), last["markov_head.markov_w2.weight"].double()
    wc = last["confidence_head.proj.weight"].double()[0]
    prev = torch.cat((tokens.view(n, gamma)[:, :1], greedy[:, :-1]), dim=1)                   # x_{k-1}, teacher-forced
    e = w1[prev]                                                                                # [n, gamma, r]
    logits_d = base + e @ w2.t()
    confidence = torch.cat((y, e), dim=-1) @ wc                                                # [n, gamma]
    return Blocks(anchors, logits_d, confidence, p_t, greedy, valid)


def dspark_loss(model, seqs: list[Sequence], ring: int | None = None,
                share: Share = Share()) -> tuple[torch.Tensor, float]:
    """DSpark's loss over every reply anchor of `seqs`, and the mean greedy-accepted prefix length per block.
    With a data-parallel `share`, `seqs` is this rank's share of a batch: the loss is divided by the whole batch's
    weight (so the ranks' losses and gradients add up to the batch's) and the mean is the whole batch's."""
    b = draft_blocks(model, seqs, ring)
    gamma = b.logits.shape[1]
    tv = 0.5 * (torch.softmax(b.logits, dim=-1) - b.target).abs().sum(-1)
    ce = torch.nn.functional.cross_entropy(b.logits.transpose(1, 2), b.greedy, reduction="none")
    bce = torch.nn.functional.binary_cross_entropy_with_logits(b.confidence, (1 - tv).detach(), reduction="none")
    weight = torch.exp(-torch.arange(gamma, dtype=torch.float64) / gamma)[None, :] * b.valid
    hit = ((b.logits.argmax(-1) == b.greedy) & b.valid).int()
    accepted = hit.cumprod(dim=1).sum(dim=1).double()
    total_weight, accepted_sum, blocks = share.sum(
        torch.stack((weight.sum().detach(), accepted.sum(), torch.tensor(len(accepted), dtype=torch.float64)))).tolist()
    loss = ((CE_WEIGHT * ce + TV_WEIGHT * tv + BCE_WEIGHT * bce) * weight).sum() / total_weight
    return loss, accepted_sum / blocks


class DrafterTrainer:
    def __init__(self, model, steps: int, lr: float = 2e-3, warmup: int = 20):
        for block in (model.params.model, *model.params.layers):      # the target and the shared embed / head
            for value in block.values():
                if isinstance(value, torch.Tensor):
                    value.requires_grad_(False)
        self.model, self.steps, self.lr, self.warmup = model, steps, lr, warmup
        self.leaves = drafter_leaves(model)
        self.ring = ring_rows(model)
        self.opt = torch.optim.AdamW(self.leaves, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.step_count = 0

    def _lr(self) -> float:
        if self.step_count < self.warmup:
            return self.lr * (self.step_count + 1) / self.warmup
        done = min(1.0, (self.step_count - self.warmup) / max(1, self.steps - self.warmup))
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))

    def step(self, seqs: list[Sequence], share: Share = Share()) -> tuple[float, float]:
        """One optimiser step on the batch `seqs`: (DSpark loss, mean greedy-accepted drafts per block). With a
        data-parallel `share`, this rank drafts the anchors of its share of the batch and the ranks' gradients are
        summed, so every rank takes the one-process step (lib/training/data_parallel.py)."""
        for group in self.opt.param_groups:
            group["lr"] = self._lr()
        # a share without a reply anchor: every rank drafts them all
        share, mine = take(seqs, share, shared_prefixes(seqs), usable=anchors_of)
        loss, accepted = dspark_loss(self.model, mine, self.ring, share)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        share.sum_grads(self.leaves)
        torch.nn.utils.clip_grad_norm_(self.leaves, 1.0)
        self.opt.step()
        self.step_count += 1
        return float(share.sum(loss.detach().double())), accepted

    def finish(self) -> None:
        for v in self.leaves:
            v.requires_grad_(False)
            v.grad = None
