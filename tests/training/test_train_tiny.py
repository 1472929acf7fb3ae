"""`dsv4gen train-tiny` (lib/training): gradients through the reference forward itself lower the reply loss, the
export reloads to exactly the weights it was given, and the command runs end to end (a few steps)."""
from __future__ import annotations

import json

import torch

from lib.cli.main import main
from lib.evaluation import tasks
from lib.evaluation.suite import prompt_text, reply_text
from lib.runtime.loaded_model import load_model
from lib.text.tokenizer import Tokenizer
from lib.training.corpus import TrainingStream, task_tokenizer
from lib.training.export import write_trained
from lib.training.indexer import distilling
from lib.training.routing import BIAS_RATE, Loads
from lib.training.target import Schedule, TargetTrainer, loss_of, reply_rows
from lib.weights.checkpoint import Checkpoint


def _runtime_tensors(params):
    named = {f"model.{k}": v for k, v in params.model.items()}
    for i, block in enumerate(params.layers + params.drafter):
        named |= {f"{i}.{k}": v for k, v in block.items()}
    return {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}


def test_reply_rows_predict_exactly_the_reply_tokens():
    tok = task_tokenizer(1024)
    seqs = TrainingStream(tok, 16, seed=1).batch(600)
    rows, targets = reply_rows(seqs)
    flat = torch.tensor([t for s in seqs for t in s.ids])
    assert torch.equal(flat[rows + 1], targets)                        # each row's next token is its target
    assert int((targets == tok.eos_id).sum()) == len(seqs)             # every reply ends with its EOS
    assert sum(len(s.ids) for s in seqs) <= 600 or len(seqs) == 1


def test_the_task_tokenizer_spells_digits_one_by_one_and_shortens_prompts():
    from lib.text.tokenizer import build_tiny_tokenizer

    task, plain = task_tokenizer(1024), Tokenizer(build_tiny_tokenizer(1024))
    assert [task.decode([i]) for i in task.encode("1234")] == ["1", "2", "3", "4"]
    seq = TrainingStream(task, 16, seed=0)
    text = "What is the capital of Varnesh? Which language do people in Brini speak?"
    assert len(task.encode(text)) < len(plain.encode(text))
    assert seq.next().ids == TrainingStream(task, 16, seed=0).next().ids     # one seed, one stream


def test_the_task_tokenizer_spells_a_copied_word_by_the_same_tokens_in_prompt_and_reply():
    tok = task_tokenizer(1024)
    for word in ("Naitros", "Kovlosal", "vlaipeoth"):
        assert tok.encode(" " + word) == tok.encode(" ") + tok.encode(word)
    ex = tasks.examples("tool_call", "train", 1, seed=0)[0]      # "Tell Naitros: ..." -> send_message(to="Naitros")
    prompt, reply = tok.encode(prompt_text(ex)), tok.encode(reply_text(ex))
    for value in json.loads(ex.reply["tool_calls"][0]["function"]["arguments"]).values():
        ids = tok.encode(str(value))
        runs = lambda seq: any(seq[i:i + len(ids)] == ids for i in range(len(seq)))
        assert runs(prompt) and runs(reply), value


def test_a_tool_calls_first_argument_is_copied_from_within_the_trained_window():
    from lib.training.loop import TrainConfig
    from lib.weights.tiny_checkpoint import PRESETS, TINY_VARIANT
    from spec.variants import variant_config

    window = variant_config(TINY_VARIANT, PRESETS[TrainConfig().preset]).sliding_window
    tok = task_tokenizer(1024)
    for ex in tasks.examples("tool_call", "heldout", 30, seed=0):
        prompt, reply = tok.encode(prompt_text(ex)), tok.encode(reply_text(ex))
        value = tok.encode(str(next(iter(json.loads(ex.reply["tool_calls"][0]["function"]["arguments"]).values()))))
        at_prompt = max(i for i in range(len(prompt)) if prompt[i:i + len(value)] == value)
        at_reply = next(i for i in range(len(reply)) if reply[i:i + len(value)] == value)
        # the reply token that starts the copy looks back this far (its query is the token before it)
        assert len(prompt) + at_reply - 1 - at_prompt < window, prompt_text(ex)


def test_the_stream_opens_with_copying_and_arithmetic_then_draws_the_whole_mix():
    from lib.training.corpus import MIX, OPENING

    stream = TrainingStream(task_tokenizer(1024), 16, seed=0, opening_batches=3)
    opening = [s.task for _ in range(3) for s in stream.batch(400)]
    later = [s.task for _ in range(12) for s in stream.batch(400)]
    assert set(opening) == set(OPENING)
    assert len(opening) / 3 > 2 * len(later) / 12                # short questions: over twice as many per batch
    assert set(later) == set(MIX)


def test_training_lowers_the_reply_loss_distils_the_indexer_and_balances_the_experts(tiny_ckpt):
    model = load_model(tiny_ckpt)
    before = {k: v.clone() for k, v in _runtime_tensors(model.params).items()}
    batch = TrainingStream(task_tokenizer(model.cfg.vocab_size), model.cfg.sliding_window, seed=0).batch(300)
    trainer = TargetTrainer(model, Schedule(steps=12, lr=3e-3, warmup=1))
    steps = [trainer.step(batch) for _ in range(12)]
    trainer.finish()
    with torch.no_grad(), distilling() as indexer:
        after = float(loss_of(model, batch))
    assert after < 0.5 * steps[0][0], steps + [after]
    assert steps[0][1] > 0 and float(indexer.loss()) < steps[0][1]       # the indexer moves towards the attention
    now = _runtime_tensors(model.params)
    changed = {k for k in before if not torch.equal(before[k], now[k])}
    assert {"model.embed.weight", "model.head.weight", "2.attn.wq_a.weight", "2.attn.indexer.weights_proj.weight",
            "2.attn.indexer.compressor.wkv.weight"} <= changed
    biases = {k for k in before if k.endswith("ffn.gate.bias") and int(k.split(".")[0]) < len(model.params.layers)}
    assert biases and biases <= changed                                  # moved by the loads, not by a gradient
    assert all(bool(((now[k] - before[k]).abs() <= 12 * BIAS_RATE + 1e-12).all()) for k in biases)
    assert not any(k.startswith(f"{len(model.params.layers)}.") for k in changed)                # the drafter waits


def test_the_weights_kept_are_the_moving_average_of_the_late_steps(tiny_ckpt):
    """Averaged over four time constants or more, finish() writes the late steps' exponential moving average into the
    weights; over fewer (a smoke run), the last step's weights are kept as they are."""
    batch = TrainingStream(task_tokenizer(1024), 16, seed=2).batch(200)
    for steps, averaged in ((8, True), (6, False)):
        model = load_model(tiny_ckpt)
        schedule = Schedule(steps=steps, lr=3e-3, warmup=1, average_from=0.0, average_decay=0.5)
        assert schedule.keeps_average == averaged
        trainer = TargetTrainer(model, schedule)
        expected = None
        for _ in range(steps):
            trainer.step(batch)
            now = [v.detach().clone() for _, v in trainer.named]
            expected = now if expected is None or not averaged else [e.lerp(n, 0.5) for e, n in zip(expected, now)]
        last = [v.detach().clone() for _, v in trainer.named]
        trainer.finish()
        kept = [v for _, v in trainer.named]
        assert all(torch.allclose(k, e, rtol=0, atol=1e-6) for k, e in zip(kept, expected))
        assert any(not torch.equal(k, x) for k, x in zip(kept, last)) == averaged
    assert Schedule(steps=2400).keeps_average and not Schedule(steps=40).keeps_average


def test_the_distillation_target_is_the_attention_over_every_visible_entry():
    from lib.training.indexer import Distillation

    d = Distillation()
    scores = torch.tensor([[0.0, 1.0, float("-inf")], [float("-inf")] * 3])
    target = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    d.add(scores.double(), target)
    log_q = torch.log_softmax(torch.tensor([0.0, 1.0]).double(), -1)
    expected = 0.5 * (torch.log(torch.tensor(0.5)) - log_q[0]) + 0.5 * (torch.log(torch.tensor(0.5)) - log_q[1])
    assert torch.allclose(d.loss(), expected)                           # the row that sees nothing is left out


def test_export_reloads_to_the_weights_it_was_given(tiny_ckpt, tmp_path):
    model = load_model(tiny_ckpt)
    tok = task_tokenizer(model.cfg.vocab_size)
    out = write_trained(tmp_path / "trained", model.params, Checkpoint(tiny_ckpt).config, tok)
    again = load_model(out)
    mine, theirs = _runtime_tensors(model.params), _runtime_tensors(again.params)
    assert mine.keys() == theirs.keys()
    assert [k for k in mine if not torch.equal(mine[k], theirs[k])] == []
    assert Tokenizer.from_dir(out).encode("What is 17+25?") == tok.encode("What is 17+25?")


def test_train_tiny_runs_end_to_end_and_records_what_it_did(tmp_path, capsys):
    out = tmp_path / "trained"
    assert main(["train-tiny", "--out", str(out), "--steps", "3", "--drafter-steps", "2", "--tokens-per-step", "256",
                 "--drafter-tokens-per-step", "256", "--eval-per-task", "1"]) == 0
    printed = capsys.readouterr().out
    record = json.loads((out / "training.json").read_text())
    assert record["config"]["steps"] == 3 and record["tokens"] > 0 and record["training_seconds"] > 0
    assert record["drafter_loss_first_20"] > 0 and "--drafter-steps 2 --drafter-tokens-per-step 256" in record["command"]
    assert record["config"]["data_parallel_size"] == 2 and "--data-parallel-size 2" in record["command"]
    held = record["heldout"]
    assert set(held["accuracy"]) == {"arithmetic", "counting", "copying", "facts", "retrieval", "tool_call"}
    assert held["dspark_replies_identical"] is True
    assert json.loads((out / "config.json").read_text())["sliding_window"] == 32   # the trained preset's window
    assert "held-out exact match" in printed and str(out) in printed
    load_model(out, "ascend910")                                         # a device backend takes it as any checkpoint
    assert main(["train-tiny", "--out", str(out), "--steps", "1"]) == 2  # refuses to overwrite without --force
    assert main(["train-tiny", "--out", str(tmp_path / "none"), "--data-parallel-size", "0"]) == 2
    assert not (tmp_path / "none").exists()


def test_the_same_seed_trains_the_same_weights_byte_for_byte(tmp_path):
    """On one machine and torch the command is deterministic: the stream, the initial weights and every update
    follow the seed, so two runs with one seed write the same weight files."""
    def run(name: str, seed: int, steps: int) -> dict[str, bytes]:
        out = tmp_path / name
        assert main(["train-tiny", "--out", str(out), "--seed", str(seed), "--steps", str(steps), "--drafter-steps",
                     "2", "--tokens-per-step", "256", "--drafter-tokens-per-step", "256", "--eval-per-task", "0"]) == 0
        return {f.name: f.read_bytes() for f in sorted(out.glob("model-*.safetensors"))}

    first, again, other = run("a", 0, 3), run("b", 0, 3), run("c", 1, 1)
    assert first and first == again
    assert other.keys() == first.keys() and other != first


def test_an_expert_above_the_mean_load_loses_bias_and_one_below_gains_it():
    bias = torch.zeros(4, dtype=torch.float64)
    loads = Loads()
    loads.add(bias, torch.tensor([[0, 1], [0, 2], [0, 1]]))          # expert 0: 3 tokens, 1: 2, 2: 1, 3: 0; mean 1.5
    loads.add(bias, torch.tensor([[3, 2]]))                           # a second forward of the same layer adds up
    loads.update_biases()                                             # totals 3, 2, 2, 1; mean 2
    assert bias.tolist() == [-BIAS_RATE, 0.0, 0.0, BIAS_RATE]


def test_the_trained_draft_block_is_the_block_the_engine_drafts(tiny_ckpt):
    """Position 0 of every training block (its Markov input is the anchor in both) equals what the engine's own
    drafting computes after committing the same positions, and so does each later position whose earlier drafts
    are the target's greedy tokens (a prefix that verification accepts)."""
    from lib.engine.drafting import context_rows, propose
    from lib.runtime.paged_step import paged_step
    from lib.records.batch import make_batch
    from lib.runtime.paged_cache import PagedCache
    from lib.training.drafter import draft_blocks

    model = load_model(tiny_ckpt)
    seqs = TrainingStream(task_tokenizer(model.cfg.vocab_size), model.cfg.sliding_window, seed=2).batch(120)[:2]
    with torch.no_grad():
        blocks = draft_blocks(model, seqs)
    gamma = model.cfg.dspark_block_size
    checked = 0
    for s in range(0, len(blocks.anchors), 3):
        c, p = blocks.anchors[s]
        ids = seqs[c].ids
        store = PagedCache.for_lengths(model, [p + 1 + gamma], rings=True, slack=gamma)
        store.add(0)
        _, hidden = paged_step(model, make_batch([ids[: p + 1]]), store, [0], with_hidden=True)
        store.write_ring(0, 0, context_rows(model, hidden, torch.arange(p + 1)))
        block = propose(model, [ids[p + 1]], store, [0], lambda logits, k: (logits.argmax(-1), logits))
        assert torch.allclose(block.probs[0, 0].double(), blocks.logits[s, 0], atol=1e-4)
        assert torch.allclose(block.confidence[0, 0].double(), blocks.confidence[s, 0], atol=1e-4)
        agree = 1
        while agree < gamma and block.tokens[0, agree - 1] == blocks.greedy[s, agree - 1] and blocks.valid[s, agree]:
            assert torch.allclose(block.probs[0, agree].double(), blocks.logits[s, agree], atol=1e-4)
            agree += 1
        checked += 1
    assert checked >= 3
