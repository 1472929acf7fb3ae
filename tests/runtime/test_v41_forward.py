"""DeepSeek-V4.1's backbone on the `cpu` reference, through the generated forward and the paged runtime that every
model runs on (`load_model`, `paged_step`): it equals the dense oracle (tests/oracle_v41.py), and is the same
bit for bit in any chunking, decoding, batching or after a rejected verify; a layer after a KV source reads the
source's pools, and the host's Engram hash ids are the whole sequence's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lib.records.batch import make_batch
from lib.runtime.loaded_model import load_model
from lib.runtime.paged_cache import PagedCache
from lib.runtime.paged_step import paged_step, prefill_logits
from tests.oracle_v41 import V41Oracle


@pytest.fixture(scope="module")
def model(v41_tiny_ckpt):
    return load_model(v41_tiny_ckpt, "cpu")


def _tokens(model, n: int, seed: int) -> list[int]:
    return torch.randint(0, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_tiny_checkpoint_has_every_v41_layer_kind(model):
    roles = [(layer.kv_role, layer.ratio, layer.candidate_source, layer.engram) for layer in model.layers]
    assert ("source", 2, False, False) in roles and ("source", 1, True, True) in roles
    assert {"swa", "reindex", "reuse"} <= {r[0] for r in roles} and {2, 1} <= {r[1] for r in roles if r[0] == "reuse"}


def test_the_reference_equals_the_dense_oracle(model, v41_tiny_ckpt):
    """40 positions: past the 16-token window, past the candidate source's budget (4 blocks of 2 entries at ratio
    1), 20 ratio-2 groups; the oracle in fp64, the reference rounding to fp32 between ops."""
    ids = _tokens(model, 40, 0)
    paged = prefill_logits(model, ids)
    dense = V41Oracle(v41_tiny_ckpt).logits(ids)
    assert paged.shape == dense.shape
    assert float((paged.double() - dense).abs().max()) < 1e-4
    assert torch.equal(paged.argmax(-1), dense.argmax(-1))


def test_a_reuser_reading_pools_nobody_wrote_is_caught_by_the_oracle(model, v41_tiny_ckpt):
    """The fault the sharing invites (V41-REFERENCE §3.5): layer 3, which reuses layer 2's entries, handed pools
    of its own that nothing writes. The oracle comparison above fails on it."""
    ids = _tokens(model, 24, 1)
    store = PagedCache.for_lengths(model, [len(ids)])
    own = store.layers[3].comp._replace(entries=torch.zeros_like(store.layers[3].comp.entries))
    store.layers = store.layers[:3] + (store.layers[3]._replace(comp=own),) + store.layers[4:]
    store.add(0)
    wrong = paged_step(model, make_batch([ids]), store, [0])[0]
    dense = V41Oracle(v41_tiny_ckpt).logits(ids)
    assert float((wrong.double() - dense).abs().max()) > 1e-2


def test_chunked_prefill_and_decoding_equal_one_prefill(model):
    ids = _tokens(model, 33, 2)
    whole = prefill_logits(model, ids)
    assert torch.equal(prefill_logits(model, ids, chunk=7), whole)
    store = PagedCache.for_lengths(model, [len(ids)])
    store.add(0)
    out = [paged_step(model, make_batch([ids[:11]]), store, [0])[0]]
    for p in range(11, len(ids)):                      # one token a step: odd and even ratio-2 positions
        out.append(paged_step(model, make_batch([ids[p:p + 1]], [p]), store, [0])[0])
    assert torch.equal(torch.cat(out), whole)


def test_sequences_stepped_together_equal_each_alone(model):
    a, b = _tokens(model, 37, 3), _tokens(model, 29, 4)
    alone = {"a": prefill_logits(model, a), "b": prefill_logits(model, b)}
    seqs = {"a": a, "b": b}
    store = PagedCache.for_lengths(model, [len(a), len(b)])
    done, got = {"a": 0, "b": 0}, {"a": [], "b": []}
    for name in seqs:
        store.add(name)
    step = 0
    while any(done[k] < len(seqs[k]) for k in seqs):
        names = [k for k in seqs if done[k] < len(seqs[k])]
        sizes = [min((9, 1, 3, 2)[(step + i) % 4], len(seqs[k]) - done[k]) for i, k in enumerate(names)]
        logits = paged_step(model, make_batch([seqs[k][done[k]:done[k] + n] for k, n in zip(names, sizes)],
                                              [done[k] for k in names]), store, names)[0]
        lo = 0
        for k, n in zip(names, sizes):
            got[k].append(logits[lo:lo + n])
            done[k] += n
            lo += n
        step += 1
    for k in seqs:
        assert torch.equal(torch.cat(got[k]), alone[k]), k


def test_a_rejected_verify_leaves_no_trace(model):
    """Speculative verify: 5 drafted tokens stored uncommitted, 2 kept, the sequence continues with other tokens.
    The window and compressor rings, the entries and the Engram ids of the rejected 3 never reach it."""
    ids = _tokens(model, 30, 5)
    drafts = _tokens(model, 5, 6)
    whole = prefill_logits(model, ids)
    store = PagedCache.for_lengths(model, [len(ids) + 8], slack=6)
    store.add(0)
    out = [paged_step(model, make_batch([ids[:15]]), store, [0])[0]]
    verify = ids[15:17] + drafts[2:]                   # the first two drafts are right, the rest wrong
    logits = paged_step(model, make_batch([verify], [15]), store, [0], commit=False)[0]
    store.set_length(0, 17)
    out.append(logits[:2])
    out.append(paged_step(model, make_batch([ids[17:]], [17]), store, [0])[0])
    assert torch.equal(torch.cat(out), whole)


def test_layers_after_a_kv_source_read_its_pools(model):
    """Layers 2 and 4 make the compressed KV (ratio 2 and 1); 3 reuses 2's, 5 and 7 reuse and 6 re-scores 4's: the
    same tensors, so nothing is copied and no layer after a source keeps entries of its own."""
    store = PagedCache.for_lengths(model, [64])
    layers = {layer.index: pools for layer, pools in zip(model.layers, store.layers)}
    assert layers[3].comp is layers[2].comp and layers[3].index is layers[2].index
    for i in (5, 6, 7):
        assert layers[i].comp is layers[4].comp and layers[i].index is layers[4].index
    assert layers[2].comp.state is not None and layers[4].comp.state is None       # ratio 1 pools nothing
    assert layers[0].comp is None and layers[1].comp is None
    owners = {s.owner for s in store.shapes if s.lifetime == "entry"}
    assert owners == {"layer2", "layer4"}
    head, index = model.cfg.head_dim, model.cfg.index_head_dim
    assert store.bytes_per_token() == 4 * (head + index) * (1 / 2 + 1 / 1)          # fp32 rows, per position


def test_engram_ids_are_the_whole_sequences(model):
    """Each step's hash ids come from the host's per-sequence state; stepped in chunks they are the ids of the
    whole sequence hashed at once (lib/engram/hashing.py)."""
    from lib.engram.hashing import hash_ids

    ids = _tokens(model, 21, 7)
    hashing = model.engram
    expected = hash_ids(hashing.token_map.compress(ids), hashing.params)
    store = PagedCache.for_lengths(model, [len(ids)])
    store.add(0)
    got, start = [], 0
    for n in (4, 1, 1, 9, 6):
        batch = make_batch([ids[start:start + n]], [start])
        store.ensure(0, start + n)
        got.append(store.address(batch, [0]).engram_ids.numpy())
        store.set_length(0, start + n)
        start += n
    assert np.array_equal(np.concatenate(got), expected)


def test_a_dspark_round_equals_the_oracles(model, v41_tiny_ckpt):
    """One greedy DSpark round after a 26-token prompt through the engine's drafter (context rings from the taps at
    the target layers' input, the stages as V4.1 blocks with their own MoE, the Markov head named embed / head):
    the oracle's anchor, drafts, base logits and confidences."""
    from lib.engine.drafting import context_rows, propose

    ids = _tokens(model, 26, 8)
    anchor, drafts, base, confidence = V41Oracle(v41_tiny_ckpt).draft(ids)
    gamma = model.cfg.dspark_block_size
    store = PagedCache.for_lengths(model, [len(ids) + gamma], rings=True, slack=gamma)
    store.add(0)
    logits, hidden = paged_step(model, make_batch([ids]), store, [0], with_hidden=True)
    assert int(logits[-1].argmax()) == anchor
    store.write_ring(0, 0, context_rows(model, hidden, torch.arange(len(ids))))
    block = propose(model, [anchor], store, [0], lambda logits, k: (logits.argmax(-1), logits))
    assert block.tokens[0].tolist() == drafts
    markov = model.params.drafter[-1]
    w1, w2 = markov["markov_head.embed.weight"].float(), markov["markov_head.head.weight"].float()
    prev = torch.tensor([anchor] + drafts[:-1])
    assert float((block.probs[0] - w1[prev] @ w2.t() - base.float()).abs().max()) < 1e-4   # U_k + W2 W1[y_{k-1}]
    assert float((block.confidence[0] - torch.tensor(confidence)).abs().max()) < 1e-4


def test_the_engine_serves_v41_and_dspark_is_lossless(model):
    """Continuous batching over the paged V4.1 state, with and without DSpark: the same greedy tokens, which are
    those of one prefill per step."""
    from lib.engine.llm_engine import Engine, EngineConfig
    from lib.engine.sampling import SamplingParams

    prompts = [_tokens(model, 19, 9), _tokens(model, 5, 10), _tokens(model, 33, 11)]
    runs = {}
    for mode in ("none", "dspark"):
        engine = Engine(model, EngineConfig(max_num_seqs=3, max_num_batched_tokens=24, speculative=mode,
                                            adaptive_drafting=False))
        runs[mode] = [r.output for r in engine.generate(prompts, SamplingParams(max_tokens=10))]
    assert runs["dspark"] == runs["none"]
    seq = list(prompts[0])
    for token in runs["none"][0]:
        assert int(prefill_logits(model, seq)[-1].argmax()) == token
        seq.append(token)


def test_python_m_serve_serves_a_v41_checkpoint_through_the_openai_client(v41_tiny_ckpt):
    """`python -m serve --model <tiny v41 dir>` (its `prepare` path): the same API as V4, DSpark on by default."""
    from tests.serve_util import MODEL, running_server

    with running_server(v41_tiny_ckpt) as server:
        client = server.client()
        assert [m.id for m in client.models.list().data] == [MODEL]
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=6, temperature=0)
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 6
        assert server.prepared.context.engine.engine.method == "dspark"
        text = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0)
        assert text.usage.completion_tokens == 5 and text.choices[0].text
