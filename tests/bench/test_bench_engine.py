"""The engine benchmark runs end to end with tiny settings and writes the JSON it promises.

No timing assertions: this checks the benchmark's plumbing (four modes, oracle drafter, lossless
check, JSON keys), not the engine's speed."""
import json

import torch

from lib.bench import speculation as bench


def test_engine_benchmark_tiny(tmp_path, capsys):
    # one thread: two on a loaded 2-core machine can be ~10x slower (the benchmark restores the count)
    threads = torch.get_num_threads()
    rc = bench.main(["--backend", "cpu", "--tokens", "4", "--batches", "1,2", "--threads", "1",
                     "--out", str(tmp_path), "--no-progress"])
    printed = capsys.readouterr().out
    assert torch.get_num_threads() == threads
    assert rc == 0, printed
    first = printed.splitlines()[0]
    assert first.startswith("$ ") and first.endswith("python -m lib.bench.speculation --backend cpu --tokens 4 "
                                                     f"--batches 1,2 --threads 1 --out {tmp_path} --no-progress")
    assert "dspark (oracle drafter)" in printed and "lossless: yes" in printed
    assert "decode ms per token after each request's first" in printed and "ratio of plain decode ms" in printed

    result = json.loads((tmp_path / "engine-bench.json").read_text())
    for key in ("command", "backend", "torch", "threads", "max_tokens", "batches", "gamma", "model_load_s",
                "runs", "speedup", "lossless", "total_wall_s"):
        assert key in result, key
    assert result["backend"] == "cpu" and result["batches"] == [1, 2] and result["lossless"] is True
    assert result["threads"] == 1 and result["gamma"] >= 1

    runs = {(r["mode"], r["batch"]): r for r in result["runs"]}
    assert set(runs) == {(m, b) for m in ("plain", "dspark", "always", "oracle") for b in (1, 2)}
    for r in runs.values():
        assert r["lossless"] is True
        assert r["generated_tokens"] == 4 * r["batch"]
        assert r["tokens_per_s"] > 0 and r["wall_s"] > 0 and r["ttft_mean_s"] > 0
        assert len(r["ttft_s"]) == r["batch"]
        # every request decodes 4 tokens: three after its first, timed from it
        assert r["decode_tokens"] == 3 * r["batch"] and 0 < r["decode_s"] < r["batch"] * r["wall_s"]
        assert r["decode_s_per_token"] == r["decode_s"] / r["decode_tokens"]
    for b in (1, 2):
        assert runs["plain", b]["tokens_per_target_forward"] == 1.0
        # the oracle's drafts are the target's own continuation: every verified draft is accepted
        oracle = runs["oracle", b]
        assert oracle["accepted"] == oracle["drafted"] and oracle["dspark_steps"] > 0
        assert oracle["engine_steps"] < runs["plain", b]["engine_steps"]
        for mode in ("dspark", "always", "oracle"):
            assert result["speedup"][mode][str(b)] > 0
            assert result["decode_speedup"][mode][str(b)] == (runs["plain", b]["decode_s_per_token"]
                                                              / runs[mode, b]["decode_s_per_token"])
        assert runs["always", b]["dspark_steps"] >= runs["dspark", b]["dspark_steps"] > 0   # adaptive drafts less


def test_task_questions_run_every_cell_on_the_same_requests(tiny_ckpt, tmp_path, capsys):
    rc = bench.main(["--backend", "cpu", "--checkpoint", str(tiny_ckpt), "--prompts", "tasks", "--tokens", "3",
                     "--batches", "1,4", "--threads", "1", "--out", str(tmp_path), "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "held-out task-mix questions" in printed and "lossless: yes" in printed
    result = json.loads((tmp_path / "engine-bench.json").read_text())
    assert result["prompts"] == "tasks"
    runs = {(r["mode"], r["batch"]): r for r in result["runs"]}
    for r in runs.values():
        assert r["requests"] == bench.N_PROMPTS and len(r["ttft_s"]) == bench.N_PROMPTS
    # one work load per cell: the same requests give the same tokens at every concurrency
    assert runs["plain", 1]["generated_tokens"] == runs["plain", 4]["generated_tokens"] == runs["oracle", 4]["generated_tokens"]
    assert runs["plain", 1]["engine_steps"] > runs["plain", 4]["engine_steps"]


def test_task_questions_of_chosen_tasks(tiny_ckpt, tmp_path, capsys):
    rc = bench.main(["--backend", "cpu", "--checkpoint", str(tiny_ckpt), "--tasks", "arithmetic,copying",
                     "--tokens", "2", "--batches", "2", "--threads", "1", "--out", str(tmp_path), "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "held-out arithmetic/copying questions" in printed
    result = json.loads((tmp_path / "engine-bench.json").read_text())
    assert result["prompts"] == "tasks" and result["tasks"] == ["arithmetic", "copying"]


def test_unknown_or_misplaced_tasks_are_refused(capsys):
    for argv in (["--tasks", "poetry"], ["--tasks", ","], ["--prompts", "tokens", "--tasks", "facts"]):
        try:
            bench.parse_args(argv)
        except SystemExit as done:
            assert done.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
    err = capsys.readouterr().err
    assert "unknown task(s) poetry" in err and "(none given)" in err and "does not go with --prompts tokens" in err
