"""bench/dispatch_summary.py: the canonical summary sees the kernels a plan launches, and two
summaries compare equal exactly when the launched kernels match."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import dispatch_summary as ds  # noqa: E402
from jax_prefix_attn.device import H100_SXM  # noqa: E402


def test_summary_counts_launched_kernels_and_compare_detects_a_change(tmp_path, capsys):
    key = (8, 1, 32, 8, 128, 1, 1024, 64, "bfloat16")
    rec = ds.summarize_shape(key, H100_SXM)
    # the flat path is the split decode (float32 partials per key split) and the one-launch
    # merge of the splits; the shared path launches at least one kernel
    decode, merge = rec["flat"]["kernels"]
    assert "out[float32[4,256,128] float32[4,256]]" in decode
    assert merge.startswith("in[float32[4,256,128] float32[4,256]] out[bfloat16[256,128] float32[256]]")
    assert len(rec["shared"]["kernels"]) >= 1
    assert rec["auto"] in (rec["flat"], rec["shared"])
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({str(key): rec}))
    changed = dict(rec, flat=dict(rec["flat"], kernels=[k + "x" for k in rec["flat"]["kernels"]]))
    b.write_text(json.dumps({str(key): changed}))
    assert ds.compare(str(a), str(a)) == 0
    assert ds.compare(str(a), str(b)) == 1
    assert "kernels differ 1" in capsys.readouterr().out
