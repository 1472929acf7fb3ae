"""The server load benchmark runs end to end (tiny settings) and writes what it prints."""
from __future__ import annotations

import json

from lib.bench.serve_load import main


def test_serve_benchmark_reports_every_level(tiny_ckpt, tmp_path, capsys):
    assert main(["--model", str(tiny_ckpt), "--concurrency", "1,2", "--requests-per-level", "1",
                 "--max-tokens", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| concurrency | requests | generated tok/s" in out
    rows = json.loads((tmp_path / "serve_bench.json").read_text())["levels"]
    assert [r["concurrency"] for r in rows] == [1, 2] and [r["requests"] for r in rows] == [1, 2]
    for r in rows:
        assert r["generated_tokens"] == 4 * r["requests"]       # ignore_eos: every request runs to max_tokens
        assert r["tokens_per_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p95_s"]
