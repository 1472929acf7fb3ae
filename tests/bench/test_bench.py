"""`dsv4gen bench` runs end to end through the real CLI with tiny sizes and writes what it promises.

No timing assertions: this checks the plumbing (rows for every engine, skipped device rows kept and
explained, ratios computed from the two measured times, greedy agreement, scaling ratios, JSON, PNG
and Markdown files, the clear refusal when a requirement is missing), not anyone's speed."""
import json

import pytest
import torch

from lib.bench import scaling as bench_scaling

from lib.bench import hf_peer
from lib.cli.main import main

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")


def test_bench_tiny_end_to_end(tiny_ckpt, tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "out"
    rc = main(["bench", "--out", str(out), "--model", str(tiny_ckpt), "--scaling-model", str(tiny_ckpt),
               "--backends", "cpu,ascend310p", "--prefill", "24,48", "--device-prefill", "24",
               "--decode-batches", "1,2", "--decode-context", "20", "--decode-steps", "2",
               "--device-decode-steps", "1", "--scaling", "32,64,128", "--scaling-runs", "2",
               "--chunk", "16"])
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
    assert scaling["sizes"] == [32, 64, 128] and scaling["chunk"] == 16
    # two timed prefills of 128 tokens, each step (one 16-token chunk) timed
    steps = scaling["step_seconds"]
    assert len(steps) == 2 and all(len(run) == 8 for run in steps)
    fastest = [min(a, b) for a, b in zip(*steps)]
    assert scaling["step_fastest"] == fastest
    # a length's cost: its chunks' fastest times; 32 tokens = the first two chunks of the 128-token prefill
    assert scaling["seconds"] == pytest.approx([sum(fastest[:2]), sum(fastest[:4]), sum(fastest)])
    s = scaling["seconds"]
    assert scaling["per_doubling"] == pytest.approx([s[1] / s[0], s[2] / s[1]])
    assert scaling["per_doubling_average"] == pytest.approx((s[2] / s[0]) ** 0.5)
    for run, own, ratios in zip(steps, scaling["seconds_runs"], scaling["per_doubling_runs"], strict=True):
        assert own == pytest.approx([sum(run[:2]), sum(run[:4]), sum(run)])
        assert ratios == pytest.approx([own[1] / own[0], own[2] / own[1]])
    # every run of the series (a process of its own) reached the bench's progress log
    assert sum(" scaling " in line and ", run " in line for line in printed.splitlines()) == 2
    assert "single runs" in printed


def test_a_length_costs_the_fastest_times_of_its_chunks():
    """Three runs of a 4-chunk prefill on a machine that slows one run's chunk now and then: each
    chunk's cost is its fastest time, and a length reads the first chunks of the longest."""
    steps = [[1.0, 1.1, 9.0, 1.3], [3.0, 1.1, 1.2, 1.3], [1.0, 5.0, 1.2, 1.4]]
    result = bench_scaling.summarise("ckpt", (512, 1024, 2048), 512, steps, load_s=0.0)
    assert result["step_fastest"] == [1.0, 1.1, 1.2, 1.3]
    assert result["seconds"] == pytest.approx([1.0, 2.1, 4.6])
    assert result["per_doubling"] == pytest.approx([2.1, 4.6 / 2.1])
    assert result["per_doubling_runs"][0] == pytest.approx([2.1, 12.4 / 2.1])      # run 1's own wall clock
    assert result["meets_target"] and result["max_per_doubling"] == pytest.approx(4.6 / 2.1)    # 2.19x


def test_scaling_lengths_must_be_read_off_one_prefill():
    with pytest.raises(ValueError, match="increasing order"):
        bench_scaling.check_sizes((1024, 512), 512)
    with pytest.raises(ValueError, match="increasing order"):
        bench_scaling.check_sizes((1024,), 512)
    with pytest.raises(ValueError, match="768 is not a multiple of the chunk"):
        bench_scaling.check_sizes((512, 768), 512)
    with pytest.raises(ValueError, match="every run needs 2 step times"):
        bench_scaling.summarise("ckpt", (512, 1024), 512, [[1.0, 2.0], [1.0]], load_s=0.0)


def test_bench_refuses_clearly_without_its_requirements(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(hf_peer, "missing_peer", lambda: ["transformers==5.23.0"])
    assert main(["bench", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "dsv4gen bench: error: the benchmark needs transformers==5.23.0" in err
    assert 'pip install -e ".[bench]"' in err
    assert not any(tmp_path.iterdir())                               # refused before writing anything


def test_bench_refuses_scaling_lengths_off_the_chunk_grid(tmp_path, capsys):
    assert main(["bench", "--out", str(tmp_path / "out"), "--scaling", "1000,2048"]) == 2
    err = capsys.readouterr().err
    assert "--scaling: scaling length 1000 is not a multiple of the chunk (512 tokens)" in err
    assert main(["bench", "--out", str(tmp_path / "out"), "--chunk", "0"]) == 2
    assert "--chunk must be >= 1" in capsys.readouterr().err               # before any length is checked against it
    assert not (tmp_path / "out").exists()
