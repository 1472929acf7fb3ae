"""The long-context benchmark runs end to end at small contexts and writes the JSON and plot it promises.

No timing assertions (a benchmark, not a timed test): this checks the plumbing (one process per
context, the timing render's parts, the state bytes the pools hold)."""
import json

from lib.bench import long_context as bench


def test_long_context_benchmark_small(tmp_path, capsys):
    rc = bench.main(["--backends", "cpu,ascend910", "--contexts", "640,320", "--chunk", "256",
                     "--decode-steps", "3", "--threads", "1", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    result = json.loads((tmp_path / "long-context.json").read_text())
    assert (tmp_path / "long-context.png").stat().st_size > 0
    assert set(result["backends"]) == {"cpu", "ascend910"}
    for backend, data in result["backends"].items():
        rows = data["rows"]
        assert [r["context"] for r in rows] == [320, 640]                      # smallest first
        for r in rows:
            assert r["prefill_tokens_per_s"] > 0 and r["decode_step_s"] > 0 and r["peak_rss_bytes"] > 0
            assert 0 < r["decode_growing_s"] < r["decode_step_s"]
            assert "attention_csa.index_select" in r["decode_parts_s"] and "attention_hca.sparse_attention" in r["decode_parts_s"]
            # what the sequence holds: its fixed slot plus its share of the entry pools
            assert r["state_bytes"] == r["kv_fixed_bytes_per_sequence"] + r["kv_bytes_per_token"] * r["context"]
        summary = data["summary"]
        assert summary["state_bytes_added"] == rows[1]["kv_bytes_per_token"] * 320
        assert f"{backend}: from 320 to 640 tokens" in printed
