"""`dsv4gen bench` runs end to end through the real CLI with tiny sizes and writes what it promises.

No timing assertions: this checks the plumbing (rows for every engine, skipped device rows kept and
explained, ratios computed from the two measured times, greedy agreement, scaling ratios, JSON, PNG
and Markdown files, the clear refusal when a requirement is missing), not anyone's speed."""
import json

import pytest
import torch

from lib import hf_peer
from lib.cli import main

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")


def test_bench_tiny_end_to_end(tiny_ckpt, tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "out"
    rc = main(["bench", "--out", str(out), "--model", str(tiny_ckpt), "--scaling-model", str(tiny_ckpt),
               "--backends", "cpu,ascend310p", "--prefill", "24,48", "--device-prefill", "24",
               "--decode-batches", "1,2", "--decode-context", "20", "--decode-steps", "2",
               "--device-decode-steps", "1", "--scaling", "32,64,128", "--scaling-repeats", "2"])
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
    assert [len(runs) for runs in scaling["seconds_all"]] == [2, 2, 2]
    assert s == [min(runs) for runs in scaling["seconds_all"]]          # the fastest pass per length
    assert scaling["per_doubling_fastest"] == pytest.approx([s[1] / s[0], s[2] / s[1]])
    # each doubling: the ratio within each pass, the ascending and the descending pass weighed
    # equally (two passes: the geometric mean of the two)
    (a0, a1), (b0, b1), (c0, c1) = scaling["seconds_all"]
    assert scaling["per_doubling"] == pytest.approx([(b0 / a0 * b1 / a1) ** 0.5, (c0 / b0 * c1 / b1) ** 0.5])
    assert scaling["per_doubling_first_to_last"] == pytest.approx((c0 / a0 * c1 / a1) ** 0.25)
    # every run of the series (a process of its own) reached the bench's progress log
    assert sum(" scaling " in line and ", pass " in line for line in printed.splitlines()) == 3 * 2


def test_bench_refuses_clearly_without_its_requirements(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(hf_peer, "missing_peer", lambda: ["transformers==5.23.0"])
    assert main(["bench", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "dsv4gen bench: error: the benchmark needs transformers==5.23.0" in err
    assert 'pip install -e ".[bench]"' in err
    assert not any(tmp_path.iterdir())                               # refused before writing anything
