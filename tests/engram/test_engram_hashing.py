"""lib/engram/hashing.py and state.py: V4.1 Engram hash ids against values derived by hand from the
equations, the image-span (DEAD) restart, and the incremental decode state against whole-sequence hashing.

The reference below is the equation of the official inference/engram.py ([EN], code-index id
71212907549) with torchtitan-npu's image-span rule ([TT], ids 69332611211 and 68299168060), written
with plain Python ints per position, independently of the vectorised module.
"""
import itertools

import numpy as np
import pytest

from lib.engram.hashing import DEAD, hash_ids, hash_params
from lib.engram.state import advance, hash_step, initial_state, step
from spec.variants import variant_config
from tests.engram.v41_engram_values import MULTIPLIERS_1, MULTIPLIERS_14, PRIMES_1, PRIMES_14

PAD = 7          # some compressed id (the real one is map[2] of the V4.1 tokenizer's map)


@pytest.fixture(scope="module")
def params():
    return hash_params(variant_config("v41-flash"), pad=PAD)


def reference(c: list[int], pad: int = PAD) -> list[list[list[int]]]:
    """hash[p][layer][column] straight from the equations, plain ints (DEAD = -1)."""
    out = []
    for p in range(len(c)):
        toks, blocked = [], False
        for s in range(4):
            blocked = blocked or p < s or c[p - s] == -1
            toks.append(pad if blocked else c[p - s])
        per_layer = []
        for primes, mult in ((PRIMES_1, MULTIPLIERS_1), (PRIMES_14, MULTIPLIERS_14)):
            products = [t * m for t, m in zip(toks, mult)]
            r = {1: products[0] ^ products[1]}
            r[2] = r[1] ^ products[2]
            r[3] = r[2] ^ products[3]
            row = []
            for n in (2, 3, 4):
                for h in range(8):
                    col = (n - 2) * 8 + h
                    row.append(r[n - 1] % primes[col] + sum(primes[:col]))
            per_layer.append(row)
        out.append(per_layer)
    return out


def test_first_position_by_hand(params):
    # position 0 of [1]: tokens (1, pad, pad, pad); R_1 = m0 ^ 7 m1, R_2 = R_1 ^ 7 m2, R_3 = R_2 ^ 7 m3
    got = hash_ids([1], params)
    m0, m1, m2, m3 = 76632096046245, 4839876093313, 35959672319349, 73987337458391
    r1 = m0 ^ (7 * m1)
    assert got.shape == (1, 2, 24) and got.dtype == np.int64
    assert got[0, 0, 0] == r1 % 16000057
    assert got[0, 0, 1] == r1 % 16000079 + 16000057
    r3 = r1 ^ (7 * m2) ^ (7 * m3)
    assert got[0, 0, 23] == r3 % 16000463 + (384_006_168 - 16000463)


def test_known_sequence_matches_the_equations(params):
    seq = [5, 17, 99_091, 0, 42, 42, 42, 1234, 99_090, 3]      # includes the largest compressed id
    assert hash_ids(seq, params).tolist() == reference(seq)


def test_hash_ids_lie_in_their_columns_buckets(params):
    got = hash_ids(list(range(0, 99_092, 997)), params)
    lay = params.layout
    for li in range(2):
        lo = np.asarray(lay.offsets[li])
        assert ((got[:, li] >= lo) & (got[:, li] < lo + np.asarray(lay.primes[li]))).all()


def test_dead_blocks_and_the_sequence_restarts_after_it(params):
    seq = [11, 12, 13, DEAD, DEAD, 21, 22, 23, 24]
    got = hash_ids(seq, params)
    assert got.tolist() == reference(seq)
    assert (got[5:] == hash_ids([21, 22, 23, 24], params)).all()          # as if it started at 21
    assert (got[3] == hash_ids([PAD], params)[0]).all()                    # a DEAD hashes all-pad
    assert (got[1] == hash_ids([11, 12], params)[1]).all()                 # before the DEAD: unchanged


def test_out_of_range_ids_refuse(params):
    with pytest.raises(ValueError, match=r"Engram ids: 99092 is neither a compressed id \(0 .. 99091\) "
                                         r"nor DEAD \(-1\)"):
        hash_ids([1, 99_092], params)
    with pytest.raises(ValueError, match="Engram history: -2"):
        hash_ids([1], params, history=[-2])
    with pytest.raises(ValueError, match="Engram pad 99092 is not a compressed id"):
        hash_params(variant_config("v41-flash"), pad=99_092)


SEQ = [3, 1, 4, 1, 5, DEAD, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]


@pytest.mark.parametrize("chunks", [
    [len(SEQ)],                              # one prefill
    [1] * len(SEQ),                          # decode from the first token
    [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1],
    [3, 5, 7, 10],
    [5, 1, 1, 1, 17],                        # prefill, decode steps, a long chunk over the DEAD
    [6, 19],                                 # a chunk ends on the DEAD
])
def test_incremental_steps_equal_the_whole_sequence(params, chunks):
    assert sum(chunks) == len(SEQ)
    whole = hash_ids(SEQ, params)
    state, parts, at = initial_state(params), [], 0
    for n in chunks:
        h, state = step(state, SEQ[at: at + n], params)
        parts.append(h)
        at += n
        assert state.tail == tuple(([DEAD] * 3 + SEQ[:at])[-3:])          # the last 3 ids, DEAD before the start
    assert (np.concatenate(parts) == whole).all()


def test_a_rejected_draft_never_enters_the_state(params):
    state = advance(initial_state(params), [3, 1, 4], params)
    drafted = [1, 5, 9, 2]
    verify = hash_step(state, drafted, params)                              # hashes, commits nothing
    assert (verify == hash_ids([3, 1, 4, *drafted], params)[3:]).all()
    kept = advance(state, drafted[:2], params)                              # two accepted
    assert kept.tail == (4, 1, 5)
    h, _ = step(kept, [6], params)
    assert (h == hash_ids([3, 1, 4, 1, 5, 6], params)[5:]).all()


def test_state_of_the_wrong_size_refuses(params):
    from lib.engram.state import EngramState
    with pytest.raises(ValueError, match="Engram state holds 2 ids, the config needs 3"):
        step(EngramState((1, 2)), [3], params)


def test_short_histories_pad_like_the_start(params):
    for hist in itertools.chain([[]], ([9] * k for k in range(1, 6))):
        assert (hash_ids([4, 5], params, history=hist) == hash_ids([*hist, 4, 5], params)[-2:]).all()
