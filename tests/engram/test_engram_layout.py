"""lib/engram/buckets.py and multipliers.py: V4.1's Engram bucket primes, offsets, table rows and hash
multipliers, computed from the spec's config and checked against the published values.

The published values are spelled out in tests/engram/v41_engram_values.py.
"""
import numpy as np
import pytest

from lib.engram.buckets import bucket_primes, is_prime, layout_from_config, next_prime
from lib.engram.multipliers import layer_multipliers, multiplier_bound, multipliers
from spec.variants import variant_config
from tests.engram.v41_engram_values import MULTIPLIERS_1, MULTIPLIERS_14, PRIMES_1, PRIMES_14, ROWS


@pytest.fixture(scope="module")
def v41():
    return variant_config("v41-flash")


def test_primality_on_known_values():
    assert [n for n in range(30) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]
    assert not is_prime(16000057 * 3) and not is_prime(4001 * 3999)      # composites near the range
    assert not is_prime(3215031751)            # strong pseudoprime to bases 2, 3, 5, 7
    assert next_prime(15_999_999) == 16000057
    assert next_prime(15_999_999, {16000057}) == 16000079


def test_the_48_primes_and_layer_sums(v41):
    lay = layout_from_config(v41)
    assert lay.layer_ids == (1, 14) and lay.n_columns == 24
    assert lay.primes == (PRIMES_1, PRIMES_14)
    assert all(is_prime(p) for p in PRIMES_1 + PRIMES_14)
    assert sum(PRIMES_1) == ROWS[0] and sum(PRIMES_14) == ROWS[1]
    assert lay.rows == ROWS == tuple(v41.engram_num_embeddings)


def test_offsets_are_running_sums_per_layer(v41):
    lay = layout_from_config(v41)
    for primes, offsets in zip((PRIMES_1, PRIMES_14), lay.offsets):
        assert offsets[0] == 0
        assert offsets == tuple(sum(primes[:c]) for c in range(24))
        assert offsets[-1] + primes[-1] == sum(primes)
    assert lay.column(2, 0) == 0 and lay.column(3, 7) == 15 and lay.column(4, 7) == 23
    with pytest.raises(ValueError, match="no Engram column for order 5"):
        lay.column(5, 0)


def test_every_order_restarts_the_search_and_no_prime_repeats():
    # Two layers, orders 2..3, 2 heads, primes above 10: each order restarts at 10 but skips seen primes.
    assert bucket_primes(2, 3, 2, 11) == ((11, 13, 17, 19), (23, 29, 31, 37))


def test_a_config_without_engram_or_with_wrong_rows_refuses(v41):
    with pytest.raises(ValueError, match="the config has no Engram: engram_layer_ids"):
        layout_from_config(variant_config("flash-0731"))
    bad = variant_config("v41-flash", {"engram_num_embeddings": [384_006_168, 384_016_683]})
    with pytest.raises(ValueError, match=r"sum to \[384006168, 384016682\] rows per layer, but the config's "
                                         r"engram_num_embeddings is \[384006168, 384016683\]"):
        layout_from_config(bad)


def test_multiplier_bound():
    assert multiplier_bound(99_092) == 46_539_438_283_891 == max(1, ((2**63 - 1) // 99_092) // 2)
    assert multiplier_bound(2**63 - 1) == 1                          # max(1, 0)


def test_the_8_multipliers(v41):
    assert v41.engram_compressed_vocab_size == 99_092
    got = multipliers(v41.engram_layer_ids, v41.engram_compressed_vocab_size, v41.engram_max_ngram_size)
    assert got == (MULTIPLIERS_1, MULTIPLIERS_14)
    for m in MULTIPLIERS_1 + MULTIPLIERS_14:
        assert m % 2 == 1 and m * 99_091 < 2**63                     # odd; every product fits int64


def test_multipliers_are_numpys_own_draws():
    # the same generator call, written out: a change of seed stride or bound shows here
    v = np.random.default_rng(10007 * 3).integers(0, multiplier_bound(1000), size=4, dtype=np.int64)
    assert layer_multipliers(3, 1000, 4) == tuple(2 * int(x) + 1 for x in v)
    assert layer_multipliers(1, 1000, 4) != layer_multipliers(1, 99_092, 4)   # the vocab size matters
