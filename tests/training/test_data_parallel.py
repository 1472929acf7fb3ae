"""Data-parallel training (lib/training/data_parallel.py): a step over two processes is the one-process step on
the whole batch, the shares are balanced, and a rank that fails fails the run by name."""
from __future__ import annotations

import pytest
import torch

from lib.runtime.loaded_model import load_model
from lib.training import data_parallel
from lib.training.corpus import TrainingStream, task_tokenizer
from lib.training.target import Schedule, TargetTrainer


def _trainer(model):
    return TargetTrainer(model, Schedule(steps=4, lr=3e-3, warmup=1))


def _batches(model):
    """Two steps of a batch shared by the ranks, then one of a single conversation, which every rank computes."""
    stream = TrainingStream(task_tokenizer(model.cfg.vocab_size), model.cfg.sliding_window, seed=0)
    return [stream.batch(300), stream.batch(300), stream.batch(8)]


def _weights(trainer) -> torch.Tensor:
    return torch.cat([v.detach().reshape(-1) for _, v in trainer.named])


def _step_rank(rank: int, world: int, init_method: str, path: str, threads: int) -> None:
    """A worker rank: the same checkpoint and batches, its share of each step; then its weights to rank 0."""
    import torch.distributed as dist

    torch.set_num_threads(threads)      # as rank 0: a reduction's rounding (the clipping norm) follows the threads
    share = data_parallel.join(rank, world, init_method)
    model = load_model(path)
    trainer = _trainer(model)
    for batch in _batches(model):
        trainer.step(batch, share)
    dist.broadcast(_weights(trainer), src=rank)


def _drafter_batches(model):
    stream = TrainingStream(task_tokenizer(model.cfg.vocab_size), model.cfg.sliding_window, seed=1)
    return [stream.batch(300), stream.batch(300)]


def _drafter(model):
    from lib.training.drafter import DrafterTrainer

    return DrafterTrainer(model, steps=4, lr=3e-3, warmup=1)


def _draft_rank(rank: int, world: int, init_method: str, path: str, threads: int) -> None:
    """A worker rank of the drafter: its share of each step; then its drafter weights to rank 0."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    share = data_parallel.join(rank, world, init_method)
    trainer = _drafter(load_model(path))
    for batch in _drafter_batches(trainer.model):
        trainer.step(batch, share)
    dist.broadcast(torch.cat([v.detach().reshape(-1) for v in trainer.leaves]), src=rank)


def _failing_rank(rank: int, world: int, init_method: str) -> None:
    raise SystemExit(3)


def test_shares_hold_every_conversation_once_in_order_and_balance_the_tokens():
    seqs = TrainingStream(task_tokenizer(1024), 32, seed=3).batch(2048)
    shares = data_parallel.split(seqs, 2)
    assert sorted(id(s) for share in shares for s in share) == sorted(id(s) for s in seqs)
    for share in shares:
        assert [seqs.index(s) for s in share] == sorted(seqs.index(s) for s in share)
    tokens = [sum(len(s.ids) for s in share) for share in shares]
    assert abs(tokens[0] - tokens[1]) <= max(len(s.ids) for s in seqs), tokens


def _after(trainer) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Each leaf's weight and the gradient of the step just taken."""
    return {name: (v.detach().clone(), None if v.grad is None else v.grad.clone()) for name, v in trainer.named}


def test_two_ranks_take_the_one_process_step_on_the_whole_batch(tiny_ckpt):
    import torch.distributed as dist

    alone = load_model(tiny_ckpt)
    solo = _trainer(alone)
    initial = _after(solo)
    solo_losses, solo_after = [], []
    for batch in _batches(alone):
        solo_losses.append(solo.step(batch))
        solo_after.append(_after(solo))
    with data_parallel.ranks(2, _step_rank, (str(tiny_ckpt), torch.get_num_threads())) as share:
        assert share.world == 2 and share.rank == 0
        model = load_model(tiny_ckpt)
        trainer = _trainer(model)
        batches = _batches(model)
        shared_losses, shared_after = [], []
        for batch in batches:
            shared_losses.append(trainer.step(batch, share))
            shared_after.append(_after(trainer))
        other_rank = torch.empty_like(_weights(trainer))
        dist.broadcast(other_rank, src=1)
    assert torch.equal(other_rank, _weights(trainer))                   # the replicas stay bit-identical
    assert all(data_parallel.split(b, 2)[1] for b in batches[:2]) and len(batches[2]) == 1
    # the same up to the rounding of the forward's batch shapes (its lower-precision pieces, e.g. the indexer's
    # FP8 activations); AdamW's first steps move each weight by about the learning rate whatever its gradient's
    # size, so a gradient that rounds to the other side of zero moves its weight the other way, and the next
    # step's loss and gradients start from weights that differ by that much
    for (ce, kl), (ce1, kl1) in zip(shared_losses, solo_losses):
        assert ce == pytest.approx(ce1, rel=1e-5) and kl == pytest.approx(kl1, rel=1e-5) and kl > 0
    for name, (weight, grad) in shared_after[1].items():               # the second shared step
        other, other_grad = solo_after[1][name]
        assert (grad is None) == (other_grad is None), name             # an expert nobody chose stays without one
        if grad is not None:
            assert float((grad - other_grad).norm()) <= 1e-3 * float(other_grad.norm()), name
        moved = other - initial[name][0]
        assert float((weight - other).norm()) <= 0.02 * float(moved.norm()), name
    biases = [n for n in shared_after[2] if n.endswith("ffn.gate.bias")]
    assert biases and all(torch.equal(shared_after[2][n][0], solo_after[2][n][0]) for n in biases)   # loads summed


def test_two_ranks_take_the_one_process_drafter_step(tiny_ckpt):
    import torch.distributed as dist

    solo = _drafter(load_model(tiny_ckpt))
    batches = _drafter_batches(solo.model)
    solo_out = []
    for batch in batches:
        solo_out.append(solo.step(batch))
        solo_grads = [None if v.grad is None else v.grad.clone() for v in solo.leaves]
    with data_parallel.ranks(2, _draft_rank, (str(tiny_ckpt), torch.get_num_threads())) as share:
        trainer = _drafter(load_model(tiny_ckpt))
        shared_out = [trainer.step(batch, share) for batch in batches]
        other_rank = torch.empty(sum(v.numel() for v in trainer.leaves), dtype=trainer.leaves[0].dtype)
        dist.broadcast(other_rank, src=1)
    assert all(data_parallel.split(b, 2)[1] for b in batches)                  # both steps shared
    assert torch.equal(other_rank, torch.cat([v.detach().reshape(-1) for v in trainer.leaves]))
    for (loss, accepted), (loss1, accepted1) in zip(shared_out, solo_out):
        assert loss == pytest.approx(loss1, rel=1e-5) and accepted == pytest.approx(accepted1, abs=0.05)
    for v, other in zip(trainer.leaves, solo_grads):                            # the second step's gradients
        assert (v.grad is None) == (other is None)
        if other is not None:
            assert float((v.grad - other).norm()) <= 1e-3 * max(float(other.norm()), 1e-12)


def test_a_rank_that_dies_fails_the_run_naming_it():
    with pytest.raises(RuntimeError, match="data-parallel rank 1 exited with code 3"):
        with data_parallel.ranks(2, _failing_rank, ()):
            pass

