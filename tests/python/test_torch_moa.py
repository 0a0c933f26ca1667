"""benchmarks/torch_moa.py: moeforge's Mixture-of-Attention and the PyTorch
MoA it is timed against (grouped projections around one SDPA call) compute
the same layer: the forward (default and fused attention) and x's gradient
agree within bf16's tolerance, on the CPU backend at tiny sizes."""

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("moeforge.torch")
import moeforge as mf  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not mf.has_cpu_backend, reason="no CPU backend")
def test_moeforge_and_the_pytorch_moa_agree(tmp_path):
    out = tmp_path / "moa.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "torch_moa.py"), "--tiny", "--device", "cpu",
                    "--shapes", "4096:8:2,2368:16:4", "--reps", "1", "--out", str(out)], check=True,
                   capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tokens"], r["heads"], r["k"]) for r in rows] == [(64, 8, 2), (37, 16, 4)]
    for r in rows:
        assert r["moeforge_y_err"] < 2e-2
        assert r["moeforge_fused_y_err"] < 2e-2
        assert r["moeforge_dx_err"] < 2e-2
        for key in ("moeforge_forward_ms", "moeforge_fused_forward_ms", "torch_forward_ms", "moeforge_step_ms",
                    "torch_step_ms"):
            assert r[key] > 0
