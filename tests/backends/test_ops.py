"""Reference ops: each graph op's implementation matches its schema, and the semantics that field
ports got wrong are pinned on hand-checkable inputs (DSV4-REFERENCE §3)."""
from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import pytest
import torch

from backends.ascend910 import lowerings as ascend910
from backends.common import rope as common_rope
from backends.cpu.ops import attention, basic, hc, moe, rope as rope_ops
from lib.records.batch import Batch, make_batch
from lib.quant.reference_formats import resolve
from spec.graph import load_graph

OPS = load_graph().graph.ops


@pytest.mark.parametrize("name", sorted(OPS))
def test_reference_signature_matches_the_op_schema(name):
    """Ports are the positional parameters in order; attrs are the remaining parameters."""
    op = OPS[name]
    params = list(inspect.signature(resolve(op.reference)).parameters)
    assert params[: len(op.inputs)] == list(op.inputs)
    assert sorted(params[len(op.inputs):]) == sorted(op.attrs)


def test_rope_rotates_interleaved_pairs_of_the_trailing_slice_and_inverts():
    x = torch.arange(12.0).reshape(1, 12)
    inv_freq = torch.tensor([1.0, 0.5])
    batch = Batch(torch.zeros(1, dtype=torch.int64), torch.tensor([1]), (1,), (0,))
    angles = rope_ops.rope_angles(batch, tables={"main": inv_freq})["main"]
    y = rope_ops.rope(x, angles, rope_dim=4)
    assert torch.equal(y[0, :8], x[0, :8])                  # "nope" part untouched
    a, b = x[0, 8].item(), x[0, 9].item()                  # pair (8, 9) rotates by 1 * 1.0
    assert y[0, 8].item() == pytest.approx(a * math.cos(1) - b * math.sin(1), abs=1e-6)
    assert y[0, 9].item() == pytest.approx(a * math.sin(1) + b * math.cos(1), abs=1e-6)
    back = rope_ops.rope(y, angles, rope_dim=4, inverse=True)
    assert torch.allclose(back, x, atol=1e-5)


@pytest.mark.parametrize("make", [rope_ops.rope_angles, common_rope.rope_angles], ids=["reference", "device"])
def test_rope_angles_cover_the_rows_and_each_ratios_completed_entries_at_m_times_e(make):
    """One record per table: the token rows' angles, then per ratio the entries the step completes
    (state.writes order) at m * e, each exactly position * theta formed in fp32."""
    inv_freq = {"main": torch.tensor([1.0, 0.25]), "compress": torch.tensor([0.5, 0.125])}
    writes = {4: SimpleNamespace(ids=torch.tensor([3, 0, 7])), 128: SimpleNamespace(ids=torch.tensor([1]))}
    batch = Batch(torch.zeros(3, dtype=torch.int64), torch.tensor([5, 9, 130]), (3,), (0,),
                  state=SimpleNamespace(writes=writes))
    out = make(batch, tables=inv_freq)
    assert sorted(out) == ["compress", "main"]
    for name, theta in inv_freq.items():
        got = out[name]
        want = lambda pos: (pos.float()[:, None] * theta[None, :]).double()
        assert torch.allclose(got.cos.double(), want(batch.positions).cos(), atol=1e-7)
        assert torch.allclose(got.sin.double(), want(batch.positions).sin(), atol=1e-7)
        assert sorted(got.entries) == [4, 128]
        for m, w in writes.items():
            entry = got.entries[m]
            assert torch.allclose(entry.cos.double(), want(w.ids * m).cos(), atol=1e-7)
            assert torch.allclose(entry.sin.double(), want(w.ids * m).sin(), atol=1e-7)
    # a batch with no addressing (the drafter's ring rows) gets the rows only
    bare = make(batch._replace(state=None), tables=inv_freq)["main"]
    assert bare.entries == {} and bare.cos.shape == (3, 2)


@pytest.mark.parametrize("inverse", [False, True])
def test_device_rope_rotates_with_the_steps_matrices_as_with_plain_angles(inverse):
    """backends/common/rope.py: the rotation matrices made once per step rotate exactly as a plain (cos, sin)
    pair does, and as the reference within fp32 rounding; ascend910's rotary inputs likewise."""
    theta = {"main": torch.tensor([1.0, 0.25, 0.01])}
    batch = Batch(torch.zeros(4, dtype=torch.int64), torch.tensor([0, 3, 17, 400]), (4,), (0,))
    step = common_rope.rope_angles(batch, tables=theta)["main"]
    assert step.rotation and step.entries == {}             # the matrices are made with the angles
    (matrices,) = step.rotation                             # block-diagonal, [[cos, sin], [-sin, cos]] per pair
    assert matrices.shape == (4, 6, 6) and torch.equal(matrices[2, 2:4, 2:4], torch.stack(
        (torch.stack((step.cos[2, 1], step.sin[2, 1])), torch.stack((-step.sin[2, 1], step.cos[2, 1])))))
    assert torch.count_nonzero(matrices[:, 0:2, 2:]) == 0 and torch.count_nonzero(matrices[:, 2:4, 4:]) == 0
    x = torch.randn(4, 2, 10)
    mine = x.clone()                                        # both ropes rotate x in place (profile `consumes: [x]`)
    got = common_rope.rope(mine, step, rope_dim=6, inverse=inverse)
    assert got.data_ptr() == mine.data_ptr() and torch.equal(got[..., :4], x[..., :4])      # unrotated channels kept
    assert torch.equal(got, common_rope.rope(x.clone(), (step.cos, step.sin), rope_dim=6, inverse=inverse))
    ref = rope_ops.rope(x, rope_ops.rope_angles(batch, tables=theta)["main"], rope_dim=6, inverse=inverse)
    assert torch.allclose(got, ref, atol=1e-5) and not torch.allclose(got, x, atol=1e-3)
    half = x.half()                                         # 310P's activations: rotated in fp32, rounded once
    wide = common_rope.rope(half.float(), step, rope_dim=6, inverse=inverse)
    assert torch.equal(common_rope.rope(half.clone(), step, rope_dim=6, inverse=inverse), wide.half())
    npu = ascend910.rope_angles(batch, tables=theta)["main"]
    assert npu.rotary
    xb = x.to(torch.bfloat16)                               # the 910's activations (its rotary inputs are bf16)
    assert torch.equal(ascend910.rope(xb.clone(), npu, rope_dim=6, inverse=inverse),
                       ascend910.rope(xb.clone(), (npu.cos, npu.sin), rope_dim=6, inverse=inverse))


def test_sinkhorn_is_doubly_stochastic_and_hc_post_contracts_the_first_index():
    c = hc.sinkhorn(torch.randn(3, 4, 4, dtype=torch.float64), iters=20, eps=1e-6)
    assert torch.allclose(c.sum(-2), torch.ones(3, 4, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(c.sum(-1), torch.ones(3, 4, dtype=torch.float64), atol=1e-3)
    comb = torch.tensor([[[0.0, 1.0], [0.0, 0.0]]])        # only comb[0, 1] = 1
    x = torch.tensor([[[1.0, 1.0], [5.0, 5.0]]])            # streams 0 and 1
    out = hc.hc_post(torch.zeros(1, 2), x, torch.zeros(1, 2), comb)
    # out-stream k receives sum_j comb[j, k] X_j: stream 1 gets X_0, stream 0 gets nothing
    assert torch.equal(out, torch.tensor([[[0.0, 0.0], [1.0, 1.0]]]))


def test_sink_only_enlarges_the_denominator():
    logits = torch.zeros(1, 1, 3, dtype=torch.float64)
    p = attention._softmax_with_sink(logits, torch.tensor([math.log(3.0)], dtype=torch.float64))
    assert torch.allclose(p, torch.full((1, 1, 3), 1 / 6, dtype=torch.float64))


def test_window_and_compressed_visibility():
    """Query t sees raw positions t-W+1..t and HCA entries w < (t+1)/m (§3.9), read through the
    batch's addressing: a one-sequence batch in slot 0 of a ring of W + 1 rows, entries in block 0."""
    from lib.records.addressing import Addressing, GroupTable

    d, window, ratio = 4, 2, 2
    kv = torch.eye(d)[:4]                                    # position p's key is basis vector p
    ring = torch.zeros(2, window + 1, d)                     # slot 0 and the trash slot
    entries = torch.zeros(16, d)                             # two complete entries, both zero keys
    i64 = lambda *v: torch.tensor(v, dtype=torch.int64)
    state = Addressing(i64(0, 0, 0, 0), i64(0), i64(0), i64(4), i64(0),
                       (GroupTable(ratio, torch.tensor([[0]], dtype=torch.int32)),), {}, {ratio: 2}, 1, 16, 16)
    q = torch.zeros(4, 1, d)                                 # uniform attention over what is visible
    batch = make_batch([[0, 0, 0, 0]])._replace(state=state)
    out, pool = attention.sparse_attention(q, kv, batch, ring, entries, None, torch.tensor([-1e9]),
                                           window=window, ratio=ratio)
    # t=3: window {2, 3} + entries w < 2 -> 4 keys, weight 1/4 each
    assert torch.allclose(out[3, 0], torch.tensor([0.0, 0.0, 0.25, 0.25]))
    # t=0: window {0}, no complete entry yet
    assert torch.allclose(out[0, 0], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # the ring keeps the last W + 1 positions, position p in row p mod 3
    assert pool is ring and torch.equal(ring[0], kv[[3, 1, 2]])


def test_routing_weights_renormalise_and_bias_only_steers_selection():
    gate = torch.eye(4)
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])                # forces expert 3 into the top-2
    weights, ids = moe.route_learned(x, gate, bias, topk=2, route_scale=1.5)
    assert sorted(ids[0].tolist()) == [0, 3]
    s = torch.sqrt(torch.nn.functional.softplus(x[0].double()))
    want = 1.5 * s[ids[0]] / s[ids[0]].sum()
    assert torch.allclose(weights[0].double(), want, atol=1e-7)
    assert weights.sum().item() == pytest.approx(1.5)
    hw, hids = moe.route_hash(x, gate, torch.tensor([[2, 1]]), torch.tensor([0]), route_scale=1.5)
    assert hids.tolist() == [[2, 1]]                          # B07: the table decides, not the gate


def test_swiglu_is_clipped():
    """B08: gate clipped above at L, up clipped to [-L, L]."""
    out = moe.clipped_swiglu(torch.tensor([100.0]), torch.tensor([-100.0]), limit=10.0)
    assert out.item() == pytest.approx(torch.nn.functional.silu(torch.tensor(10.0)).item() * -10.0)


def test_grouped_linear_uses_each_group_block():
    x = torch.arange(8.0).reshape(1, 4, 2)                   # 4 heads of dim 2, 2 groups
    w = torch.zeros(2, 4)
    w[0, 0] = 1.0                                            # group 0, row 0 reads head 0 dim 0
    w[1, 3] = 1.0                                            # group 1, row 0 reads head 3 dim 1
    assert basic.grouped_linear(x, w, groups=2).tolist() == [[[0.0], [7.0]]]
