"""Training the target model through the reference forward itself.

The `cpu` backend's generated forward holds every weight as a float64 tensor and is built of differentiable torch
ops, so the trainer makes those tensors leaves that require grad and steps them with AdamW: the model trained is, op
for op, the model every backend is checked against, and its weights go back into the official format by the same
codecs the loader reads (export.py). Each batch is a set of whole conversations prefilled together in a fresh paged
cache, as the runtime prefills a batch of prompts, a prompt opening several of them share computed once (prefill);
logits are computed only for the rows whose next token is part of a reply.

Selections are not differentiable: the indexer's top-k passes no gradient to the indexer, which learns from its
own distillation loss instead (indexer.py, weighted INDEXER_WEIGHT in the total), and the routers' bias-adjusted
top-k passes none to the selection biases, which follow the experts' loads instead (routing.py). The learned
routers' scores (the weights that scale each chosen expert) are trained like every other weight.
Must not know the task mix or the checkpoint format.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from lib.records.batch import make_batch
from lib.runtime.paged_cache import PagedCache
from lib.training.corpus import Sequence
from lib.training.data_parallel import Share, take
from lib.training.indexer import distilling
from lib.training.routing import balancing

INDEXER_WEIGHT = 0.1     # the indexer's KL beside the reply cross-entropy (it reaches the shared q path too)
# A prompt opening that conversations share for this many tokens or more is computed once per batch (prefill): a
# long fixed preamble (a system prompt, a tools block) is worth a second forward, the few tokens every chat
# template opens with are not.
MIN_SHARED = 64


class Schedule(NamedTuple):
    steps: int
    lr: float = 2e-3
    warmup: int = 50
    final: float = 0.1          # the learning rate ends at this share of its peak (cosine decay)
    average_from: float = 0.5   # share of the steps after which an exponential moving average of the weights is kept
    average_decay: float = 0.996    # its decay per step (a time constant of 250 steps)
    weight_decay: float = 0.01
    clip: float = 1.0

    @property
    def keeps_average(self) -> bool:
        """Whether the averaged steps span four time constants: in a shorter run the average would still be mostly
        the weights it started from (0.996 over 20 steps keeps 92% of them), not an average of the late steps."""
        return (1.0 - self.average_from) * self.steps * (1.0 - self.average_decay) >= 4.0

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        done = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.final + (1 - self.final) * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


def trainable(model) -> list[tuple[str, torch.Tensor]]:
    """The backbone's floating-point weights (not the drafter's: it is trained on the finished target), as
    leaves that require grad, named `layer.key` (`model.key` outside the blocks)."""
    named = [(f"model.{k}", v) for k, v in model.params.model.items()]
    named += [(f"{i}.{k}", v) for i, block in enumerate(model.params.layers) for k, v in block.items()]
    leaves = []
    for name, value in named:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value.requires_grad_(True)
            leaves.append((name, value))
    return leaves


def reply_rows(seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch rows whose logits predict a reply token, and those tokens."""
    rows, targets, offset = [], [], 0
    for s in seqs:
        rows += range(offset + s.reply_start - 1, offset + len(s.ids) - 1)
        targets += s.ids[s.reply_start:]
        offset += len(s.ids)
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(targets, dtype=torch.int64)


def shared_prefixes(seqs: list[Sequence]) -> list[tuple[int, list[int]]]:
    """Conversations whose prompts open with the same tokens (a shared preamble): for each group of two or more that
    share at least MIN_SHARED tokens, (the tokens they share, stopped a token before the earliest reply, so every
    row that predicts a reply token is a member's own; the members' indices)."""
    by_opening: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(seqs):
        if s.reply_start - 1 >= MIN_SHARED:
            by_opening.setdefault(tuple(s.ids[:MIN_SHARED]), []).append(i)
    groups = []
    for members in by_opening.values():
        if len(members) < 2:
            continue
        first, n = seqs[members[0]].ids, min(seqs[m].reply_start for m in members) - 1
        for m in members[1:]:
            n = next((k for k in range(MIN_SHARED, n) if seqs[m].ids[k] != first[k]), n)
        groups.append((n, members))
    return groups


def prefill(model, seqs: list[Sequence], logit_rows: torch.Tensor | None = None):
    """The reference forward over whole conversations prefilled together from position 0 in a fresh paged cache (as
    the runtime prefills a batch of prompts; outside inference_mode, so gradients flow): (logits of `logit_rows`
    or of every row, main_hidden), rows numbered as the conversations' tokens laid end to end.

    A prompt opening that several conversations share (shared_prefixes) is computed once: a first forward prefills
    each such opening as a sequence of its own, the cache forks it into every member (PagedCache.fork: copies, so
    gradients pass back through them), and a second forward continues the members from there beside the other
    conversations from position 0. The values are those of one forward, as chunked prefill's are; a shared row's
    gradient is the sum of what each member's own copy of it would get."""
    groups = shared_prefixes(seqs)
    starts = [0] * len(seqs)
    for n, members in groups:
        for m in members:
            starts[m] = n
    where, opening_rows = _row_layout(seqs, groups, starts)
    wanted = None if logit_rows is None else [where[r] for r in logit_rows.tolist()]
    picked = [None, None] if wanted is None else [sorted({j for k, j in wanted if k == f}) for f in (0, 1)]
    store = PagedCache.for_lengths(model, [len(s.ids) for s in seqs] + [n for n, _ in groups])
    openings = [("opening", g) for g in range(len(groups))]
    outs = []
    if groups:
        for h in openings:
            store.add(h)
        outs.append(_forward(model, store, openings, [seqs[members[0]].ids[:n] for n, members in groups], picked[0]))
    for i in range(len(seqs)):
        store.add(i)
    for h, (_, members) in zip(openings, groups):
        for m in members:
            store.fork(h, m)
    outs.append(_forward(model, store, list(range(len(seqs))), [s.ids[a:] for s, a in zip(seqs, starts)],
                         picked[1], starts))
    if not groups:
        return outs[0]
    (l0, h0), (l1, h1) = outs
    # each wanted row's place in the two forwards' logits laid end to end
    at = {(0, j): x for x, j in enumerate(range(opening_rows) if picked[0] is None else picked[0])}
    at.update({(1, j): len(at) + x for x, j in enumerate(range(len(where) - opening_rows) if picked[1] is None
                                                          else picked[1])})
    logits = torch.cat((l0, l1)).index_select(0, torch.tensor([at[w] for w in (where if wanted is None else wanted)],
                                                                dtype=torch.int64))
    hidden = None if h1 is None else torch.cat((h0, h1)).index_select(
        0, torch.tensor([j if k == 0 else opening_rows + j for k, j in where], dtype=torch.int64))
    return logits, hidden


def _row_layout(seqs: list[Sequence], groups, starts: list[int]) -> tuple[list[tuple[int, int]], int]:
    """Where each row of the conversations laid end to end is computed: (0, row of the openings' forward) for a
    position inside its group's shared opening, else (1, row of the second forward); and the openings' rows."""
    first = [0]
    for n, _ in groups:
        first.append(first[-1] + n)
    group_of = {m: g for g, (_, members) in enumerate(groups) for m in members}
    where, rest = [], 0
    for i, s in enumerate(seqs):
        where += [(0, first[group_of[i]] + t) if t < starts[i] else (1, rest + t - starts[i]) for t in range(len(s.ids))]
        rest += len(s.ids) - starts[i]
    return where, first[-1]


def _forward(model, store: PagedCache, seq_ids: list, chunks: list[list[int]], logit_rows: list[int] | None,
             starts: list[int] | None = None):
    """One reference forward of `chunks` continuing `seq_ids` at `starts` (default 0), each committed after it:
    (logits of logit_rows, or of every row, main_hidden)."""
    ends = [start + len(chunk) for chunk, start in zip(chunks, starts or [0] * len(chunks))]
    for seq_id, end in zip(seq_ids, ends):
        store.ensure(seq_id, end)
    rows = None if logit_rows is None else torch.tensor(logit_rows, dtype=torch.int64)
    batch = store.address(make_batch(chunks, starts)._replace(logit_rows=rows), seq_ids, None)
    logits, _, hidden = model.forward(model.params, batch, store.layers, model.cfg, model.rope)
    for seq_id, end in zip(seq_ids, ends):
        store.set_length(seq_id, end)
    return logits, hidden


def loss_of(model, seqs: list[Sequence], replies: int | None = None) -> torch.Tensor:
    """Cross-entropy of the reply tokens of `seqs`, prefilled together from position 0: the mean over each reply's
    tokens, then over the replies (a 70-token tool call weighs as much as a 3-token sum, not 23 times more).
    `replies`: the whole batch's replies when `seqs` is one data-parallel rank's share of it (default len(seqs)),
    so that the ranks' losses add up to the batch's. The value and its gradients are those of each conversation
    prefilled alone, shared openings or not (prefill)."""
    rows, targets = reply_rows(seqs)
    logits, _ = prefill(model, seqs, rows)
    per_token = torch.nn.functional.cross_entropy(logits.double(), targets, reduction="none")
    owner = torch.repeat_interleave(torch.tensor([len(s.ids) - s.reply_start for s in seqs]))
    per_reply = torch.zeros(len(seqs), dtype=per_token.dtype).index_add_(0, owner, per_token)
    return (per_reply / torch.bincount(owner, minlength=len(seqs))).sum() / (replies or len(seqs))


class TargetTrainer:
    def __init__(self, model, schedule: Schedule):
        self.model, self.schedule = model, schedule
        self.named = trainable(model)
        decay = [v for n, v in self.named if v.dim() >= 2]
        keep = [v for n, v in self.named if v.dim() < 2]        # norms, sinks, biases, scales: no decay
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": schedule.weight_decay},
                                      {"params": keep, "weight_decay": 0.0}], lr=schedule.lr, betas=(0.9, 0.95))
        self.step_count = 0
        self.average: list[torch.Tensor] | None = None      # the weights' moving average, once it starts

    def step(self, seqs: list[Sequence], share: Share = Share()) -> tuple[float, float]:
        """One optimiser step on the batch `seqs`: (reply cross-entropy, indexer KL; 0 without CSA entries).
        With a data-parallel `share`, this rank computes its share of the batch and the ranks' gradients,
        losses and expert loads are summed, so every rank takes the same step (lib/training/data_parallel.py)."""
        for group in self.opt.param_groups:
            group["lr"] = self.schedule.lr_at(self.step_count)
        # too few to share (a group stays whole): every rank computes the whole batch
        share, mine = take(seqs, share, shared_prefixes(seqs))
        with distilling() as indexer, balancing() as loads:
            ce = loss_of(self.model, mine, len(seqs))
        kl = indexer.loss(share)
        total = ce if kl is None else ce + INDEXER_WEIGHT * kl
        self.opt.zero_grad(set_to_none=True)
        total.backward()
        leaves = [v for _, v in self.named]
        share.sum_grads(leaves)
        torch.nn.utils.clip_grad_norm_(leaves, self.schedule.clip)
        self.opt.step()
        loads.update_biases(share)
        self.step_count += 1
        self._average(leaves)
        losses = torch.tensor([float(ce.detach()), 0.0 if kl is None else float(kl.detach())], dtype=torch.float64)
        ce_all, kl_all = share.sum(losses).tolist()
        return ce_all, kl_all

    @torch.no_grad()
    def _average(self, leaves: list[torch.Tensor]) -> None:
        # The last steps' weights move by the noise of their small batches as much as by what they learn, and which
        # held-out questions a run gets right moves with them; the average over the late steps is what is kept.
        if not self.schedule.keeps_average or self.step_count < self.schedule.average_from * self.schedule.steps:
            return
        if self.average is None:
            self.average = [v.detach().clone() for v in leaves]
        else:
            torch._foreach_lerp_(self.average, leaves, 1.0 - self.schedule.average_decay)

    def finish(self) -> None:
        """Back to inference: the weights become their moving average (when kept) and stop requiring grad (the engine
        runs under inference_mode)."""
        for i, (_, v) in enumerate(self.named):
            v.requires_grad_(False)
            v.grad = None
            if self.average is not None:
                v.copy_(self.average[i])
        self.average = None
