"""`dsv4gen bench` runs end to end through the real CLI with tiny sizes and writes what it promises.

No timing assertions: this checks the plumbing (rows for every engine, skipped device rows kept and
explained, ratios computed from the two measured times, greedy agreement, scaling ratios, JSON, PNG
and Markdown files, the clear refusal when a requirement is missing), not anyone's speed."""
import json

import pytest
import torch

from lib import bench_scaling, hf_peer
from lib.cli import main

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")


def test_bench_tiny_end_to_end(tiny_ckpt, tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "out"
    rc = main(["bench", "--out", str(out), "--model", str(tiny_ckpt), "--scaling-model", str(tiny_ckpt),
               "--backends", "cpu,ascend310p", "--prefill", "24,48", "--device-prefill", "24",
               "--decode-batches", "1,2", "--decode-context", "20", "--decode-steps", "2",
               "--device-decode-steps", "1", "--scaling", "32,64,128", "--scaling-sweeps", "2"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert torch.get_num_threads() == threads                       # the bench restores the thread count
    assert printed.startswith("$ dsv4gen bench --out ")
    assert "x per doubling" in printed and "not run" in printed

    result = json.loads((out / "bench.json").read_text())
    for key in ("command", "plan", "checkpoint", "torch", "transformers", "threads", "rows", "load_s", "scaling",
                "reference_agrees", "total_wall_s"):
        assert key in result, key
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| cpu | decode | batch 2 (2 steps) |" in (out / "bench.md").read_text()

    rows = {(r["engine"], r["phase"], r["size"]): r for r in result["rows"]}
    expected = {(e, "prefill", n) for e in ("transformers", "cpu", "ascend310p") for n in (24, 48)}
    expected |= {(e, "decode", b) for e in ("transformers", "cpu", "ascend310p") for b in (1, 2)}
    assert set(rows) == expected
    skipped = rows["ascend310p", "prefill", 48]
    assert skipped["status"] == "skipped" and "--device-prefill" in skipped["reason"]
    for (engine, phase, size), row in rows.items():
        if row["status"] != "ok":
            continue
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
        if engine == "transformers":
            continue
        peer = rows["transformers", phase, size]
        assert row["peer_tokens_per_s"] == peer["tokens_per_s"]
        assert row["ratio"] == pytest.approx(row["tokens_per_s"] / peer["tokens_per_s"])
        assert 0 <= row["agree"] <= row["compared"]
    assert rows["cpu", "decode", 2]["tokens"] == 2 * 2 and rows["ascend310p", "decode", 2]["decode_steps"] == 1
    # the fp32 reference is the same model as transformers: its greedy tokens agree
    assert result["reference_agrees"]
    assert rows["cpu", "prefill", 48]["agree"] == rows["cpu", "prefill", 48]["compared"] == 1

    scaling = result["scaling"]
    assert scaling["sizes"] == [32, 64, 128] and len(scaling["seconds"]) == 3
    s = scaling["seconds"]
    # two sweeps over three lengths: 32, 64, 128 up, then 64, 32 down (the longest not run twice in a row)
    assert [i for i, _ in scaling["timeline"]] == [0, 1, 2, 1, 0]
    assert [len(runs) for runs in scaling["seconds_all"]] == [2, 2, 1]
    assert s == [min(runs) for runs in scaling["seconds_all"]]          # the fastest run per length
    assert scaling["per_doubling_fastest"] == pytest.approx([s[1] / s[0], s[2] / s[1]])
    # each doubling: the ratio of its two lengths measured back to back, the upward and the
    # downward pairs weighed equally (here one of each: their geometric mean)
    (a0, a1), (b0, b1), (c0,) = scaling["seconds_all"]
    assert scaling["per_doubling"] == pytest.approx([(b0 / a0 * b1 / a1) ** 0.5, (c0 / b0 * c0 / b1) ** 0.5])
    assert scaling["per_doubling_average"] == pytest.approx((scaling["per_doubling"][0] * scaling["per_doubling"][1]) ** 0.5)
    # every run of the series (a process of its own) reached the bench's progress log
    assert sum(" scaling " in line and ", run " in line for line in printed.splitlines()) == 5


def test_zigzag_measures_every_neighbouring_pair_both_ways():
    assert bench_scaling.zigzag(4, 4) == [0, 1, 2, 3, 2, 1, 0, 1, 2, 3, 2, 1, 0]
    assert bench_scaling.zigzag(1, 3) == [0]
    pairs = list(zip(bench_scaling.zigzag(6, 4), bench_scaling.zigzag(6, 4)[1:]))
    for lo in range(5):                                                 # 2 upward and 2 downward pairs each
        assert pairs.count((lo, lo + 1)) == 2 and pairs.count((lo + 1, lo)) == 2


def test_short_lengths_get_twice_the_pairs():
    sizes = (1024, 2048, 4096, 8192, 16384, 32768)
    order = bench_scaling.schedule(sizes, 4)
    assert order[:21] == bench_scaling.zigzag(6, 4)                     # every length first
    assert order[21:] == [1, 2, 1, 0, 1, 2, 1, 0]                       # then 1K-4K (<= 32K / 8) again
    pairs = list(zip(order, order[1:]))
    assert [pairs.count((lo, lo + 1)) + pairs.count((lo + 1, lo)) for lo in range(5)] == [8, 8, 4, 4, 4]
    assert bench_scaling.schedule((32, 64, 128), 2) == [0, 1, 2, 1, 0]  # no length is an eighth of 128


def test_steady_drift_cancels_between_directions():
    """Prefill cost exactly 2.1x per doubling on a machine slowing 5% per measurement: every
    back-to-back pair is off by 5% (up inflated, down deflated), the balanced ratio is not."""
    sizes = (1024, 2048, 4096, 8192)
    order = bench_scaling.zigzag(len(sizes), 4)
    timeline = [[n, 2.1 ** n * 1.05 ** k] for k, n in enumerate(order)]
    result = bench_scaling.summarise("ckpt", sizes, timeline, load_s=0.0)
    assert result["per_doubling"] == pytest.approx([2.1] * 3)
    assert result["per_doubling_samples"][0]["up"] == pytest.approx([2.1 * 1.05] * 2)
    assert result["meets_target"] and result["per_doubling_average"] == pytest.approx(2.1)


def test_bench_refuses_clearly_without_its_requirements(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(hf_peer, "missing_peer", lambda: ["transformers==5.23.0"])
    assert main(["bench", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "dsv4gen bench: error: the benchmark needs transformers==5.23.0" in err
    assert 'pip install -e ".[bench]"' in err
    assert not any(tmp_path.iterdir())                               # refused before writing anything
