"""`dsv4gen run` and `dsv4gen logits`, called as users call them.

In-process through lib.cli.main.main (fast), plus one real subprocess of the console script on the
embedded tiny checkpoint: the README's main-job command.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import prompt_ids
from lib.text.chat_encoding import encode_messages
from lib.cli.main import main
from lib.engine.greedy import all_logits, greedy
from lib.runtime.loaded_model import load_model
from lib.weights.tiny_checkpoint import make_tiny
from lib.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("cli") / "ckpt")


def test_run_prints_the_greedy_continuation_of_the_chat_encoded_prompt(ckpt, capsys):
    assert main(["run", "--model", str(ckpt), "--prompt", "What is 2+2?", "--max-tokens", "12"]) == 0
    out = capsys.readouterr().out
    tok = Tokenizer.from_dir(ckpt)
    ids = tok.encode(encode_messages([{"role": "user", "content": "What is 2+2?"}]))
    assert ids[0] == tok.bos_id and tok.token_to_id("<｜Assistant｜>") in ids     # V4 encoding (B19)
    tokens = list(greedy(load_model(ckpt), ids, 12, frozenset({tok.eos_id})))
    assert len(tokens) >= 1
    assert out == tok.decode(tokens, skip_special_tokens=True) + "\n"


def test_run_raw_skips_the_chat_encoding(ckpt, capsys):
    assert main(["run", "--model", str(ckpt), "--prompt", "abc", "--raw", "--max-tokens", "4"]) == 0
    tok = Tokenizer.from_dir(ckpt)
    tokens = list(greedy(load_model(ckpt), tok.encode("abc"), 4, frozenset({tok.eos_id})))
    assert capsys.readouterr().out == tok.decode(tokens, skip_special_tokens=True) + "\n"


def test_run_in_graph_mode_replays_captured_decode_steps_with_the_same_tokens(ckpt, capsys):
    """--no-enforce-eager on the CPU: decode steps replay the exported step graph (bucket 1)."""
    prompt = "What is 2+2?"
    assert main(["run", "--model", str(ckpt), "--prompt", prompt, "--raw", "--max-tokens", "5", "--speculative", "none",
                 "--no-enforce-eager", "--stats"]) == 0
    captured = capsys.readouterr()
    tok = Tokenizer.from_dir(ckpt)
    ids = tok.encode(prompt)
    tokens = list(greedy(load_model(ckpt), ids, 5, frozenset({tok.eos_id})))
    assert len(ids) > 1 and captured.out == tok.decode(tokens, skip_special_tokens=True) + "\n"
    assert "graph mode: 1 graphs captured" in captured.err
    # the prompt's prefill runs eagerly (several tokens), every decode step replays the graph
    assert f"graph mode: {len(tokens) - 1} steps replayed captured graphs, 1 ran eagerly" in captured.err


def test_logits_writes_every_position(ckpt, tmp_path, capsys):
    ids = prompt_ids(20, 1024)
    out = tmp_path / "logits.npy"
    assert main(["logits", "--model", str(ckpt), "--ids", ",".join(map(str, ids)), "--out", str(out)]) == 0
    saved = np.load(out)
    assert saved.dtype == np.float32 and saved.shape == (20, 1024)
    assert torch.equal(torch.from_numpy(saved), all_logits(load_model(ckpt), ids))
    assert not list(tmp_path.glob(".*tmp*"))


@pytest.mark.parametrize("ids, message", [("1,x,3", "--ids must be comma-separated integers"),
                                          ("1,99999", "token id 99999 is outside the vocabulary")])
def test_logits_rejects_bad_ids(ckpt, tmp_path, capsys, ids, message):
    assert main(["logits", "--model", str(ckpt), "--ids", ids, "--out", str(tmp_path / "x.npy")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.npy").exists()


def test_main_job_command_on_the_embedded_checkpoint(tmp_path):
    """README: `dsv4gen run --prompt ...` with no --model makes and uses the embedded tiny checkpoint."""
    env = {**os.environ, "DSV4GEN_CACHE": str(tmp_path)}
    exe = os.path.join(os.path.dirname(sys.executable), "dsv4gen")
    proc = subprocess.run([exe, "run", "--prompt", "Hello", "--max-tokens", "8"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "embedded tiny checkpoint" in proc.stderr
    made = list(tmp_path.glob("tiny-*/config.json"))
    assert len(made) == 1
    assert proc.stdout.endswith("\n") and len(proc.stdout) > 1
