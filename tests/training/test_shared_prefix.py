"""Shared prompt openings in training (lib/training/target.py prefill): conversations that open with the same tokens
are computed as their opening once, forked in the paged cache, and continued; the batch's logits, main_hidden, loss
and gradients are those of each conversation prefilled alone, and data-parallel shares keep a group on one rank."""
from __future__ import annotations

import torch

from helpers import prompt_ids
from lib.runtime.loaded_model import load_model
from lib.training import data_parallel
from lib.training.corpus import Sequence, TrainingStream, task_tokenizer
from lib.training.indexer import distilling
from lib.training.target import MIN_SHARED, loss_of, prefill, reply_rows, shared_prefixes, trainable


def _conversations(vocab: int) -> list[Sequence]:
    """Three conversations opening with the same 70 tokens (two of them 4 more), one that opens otherwise, one short."""
    opening = prompt_ids(70, vocab, seed=21)
    tails = [prompt_ids(n, vocab, seed=30 + n) for n in (12, 9, 15)]
    tails[1][:4] = tails[0][:4]
    return [Sequence("a", opening + tails[0], 76), Sequence("other", prompt_ids(90, vocab, seed=22), 80),
            Sequence("b", opening + tails[1], 77), Sequence("short", prompt_ids(20, vocab, seed=23), 15),
            Sequence("c", opening + tails[2], 78)]


def test_openings_are_grouped_up_to_what_every_member_shares_before_its_reply():
    seqs = _conversations(1000)
    assert shared_prefixes(seqs) == [(70, [0, 2, 4])]
    two = [seqs[0], seqs[2]]
    assert shared_prefixes(two) == [(74, [0, 1])]
    early = [seqs[0], seqs[2]._replace(reply_start=72)]         # no member's reply row is computed once
    assert shared_prefixes(early) == [(71, [0, 1])]
    short = [s._replace(ids=s.ids[:MIN_SHARED], reply_start=MIN_SHARED - 1) for s in two]
    assert shared_prefixes(short) == [] and shared_prefixes(seqs[:2]) == []


def _grads(named) -> dict[str, torch.Tensor]:
    out = {n: v.grad.clone() for n, v in named if v.grad is not None}
    for _, v in named:
        v.grad = None
    return out


def test_a_batch_with_shared_openings_is_its_conversations_prefilled_alone(tiny_ckpt):
    model = load_model(tiny_ckpt)
    named = trainable(model)
    seqs = _conversations(model.cfg.vocab_size)
    rows, _ = reply_rows(seqs)
    logits, hidden = prefill(model, seqs, rows)
    every, every_hidden = prefill(model, seqs)
    alone = [prefill(model, [s]) for s in seqs]
    assert torch.equal(every.index_select(0, rows), logits)
    assert (every - torch.cat([a for a, _ in alone])).abs().max() <= 1e-5
    assert (every_hidden - torch.cat([h for _, h in alone])).abs().max() <= 1e-5

    loss_of(model, seqs).backward()
    together = _grads(named)
    for s in seqs:
        loss_of(model, [s], len(seqs)).backward()
    each = _grads(named)
    assert together.keys() == each.keys() and len(together) > 10
    for name, g in together.items():
        assert (g - each[name]).norm() <= 1e-5 * max(1.0, float(each[name].norm())), name
    # the shared rows get gradient from every member: the embedding of an opening token
    emb = together["model.embed.weight"]
    assert emb[seqs[0].ids[3]].abs().sum() > 0


def test_the_indexer_loss_keeps_one_term_per_csa_layer_over_both_forwards(tiny_ckpt):
    model = load_model(tiny_ckpt)
    csa = sum(layer.attention == "csa" for layer in model.layers)
    seqs = _conversations(model.cfg.vocab_size)
    for batch in (seqs, seqs[:1]):
        with distilling() as record:
            loss_of(model, batch)
        assert csa and len(record.sums) == len(record.rows) == csa
        assert all(n > 0 for n in record.rows) and record.loss() is not None


def test_a_group_of_shared_openings_goes_to_one_rank_counted_once():
    seqs = TrainingStream(task_tokenizer(1024), 32, seed=3, opening_batches=0).batch(6000)
    groups = shared_prefixes(seqs)
    assert groups and max(len(members) for _, members in groups) >= 2, [s.task for s in seqs]
    shares = data_parallel.split(seqs, 2, groups)
    assert sorted(id(s) for share in shares for s in share) == sorted(id(s) for s in seqs)
    for n, members in groups:
        assert sum(all(seqs[m] in share for m in members) for share in shares) == 1
    # each share's tokens with a group's opening counted once; no share more than the costliest unit over the other
    per = data_parallel.PER_SEQUENCE
    unit = {m: n + sum(len(seqs[k].ids) - n + per for k in members) for n, members in groups for m in members}
    cost = [sum(len(s.ids) + per for s in share) - sum(n * (sum(seqs[m] in share for m in members) - 1)
                                                       for n, members in groups) for share in shares]
    assert abs(cost[0] - cost[1]) <= max(unit.get(i, len(s.ids) + per) for i, s in enumerate(seqs)), cost
