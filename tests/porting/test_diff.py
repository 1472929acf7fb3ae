"""`dsv4gen diff`: the review tables of two backends (golden) and a spec edit seen as generated code."""
from __future__ import annotations

import shutil
from pathlib import Path

from lib.cli.main import main
from lib.porting.review_diff import backend_diff, spec_diff
from spec.tables import SPEC_DIR

GOLDEN = Path(__file__).parent / "golden" / "diff-ascend310p-ascend910.txt"


def test_310p_vs_910_matches_the_golden_review(capsys):
    """Regenerate after an intended profile change: dsv4gen diff --backend ascend310p --against
    ascend910 > tests/porting/golden/diff-ascend310p-ascend910.txt, and review the diff of that file."""
    assert main(["diff", "--backend", "ascend310p", "--against", "ascend910"]) == 0
    assert capsys.readouterr().out == GOLDEN.read_text()


def test_backend_diff_marks_what_differs():
    text = backend_diff("ascend310p", "ascend910")
    lines = {line[2:].split()[0]: line for line in text.splitlines()
             if line[:2] in ("* ", "  ") and len(line[2:].split()) > 2}
    assert lines["routed_expert"].startswith("*") and "w4a8_channel" in lines["routed_expert"]
    assert lines["hc"].startswith(" ")                                 # both keep hyper-connections in fp32
    assert "npu_quant_grouped_matmul_dequant" in text and "npu_grouped_matmul" in text
    assert backend_diff("hip936", "hip936").count("\n* ") == 0         # a backend never differs from itself


def test_spec_edit_shows_up_as_generated_code_diff(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(SPEC_DIR, old)
    shutil.copytree(SPEC_DIR, new)
    graph = (new / "graph.yaml").read_text()
    edited = graph.replace("{op: hc_post, args: {y: f, x: x_mid, post: post_ffn, comb: comb_ffn}, out: [x_out]}",
                           "{op: hc_post, args: {y: f, x: x_mid, post: post_attn, comb: comb_ffn}, out: [x_out]}")
    assert edited != graph
    (new / "graph.yaml").write_text(edited)
    out = spec_diff(old, new, "ascend310p")
    assert "-    x_out = _hc.hc_post(f, x_mid, post_ffn, comb_ffn)" in out
    assert "+    x_out = _hc.hc_post(f, x_mid, post_attn, comb_ffn)" in out
    assert "no change" in spec_diff(old, old, "ascend310p")
