"""benchmarks/fp8_accuracy.py: the bf16 and the FP8 runs start from the same
weights and batches (their first losses agree to FP8's error), both learn,
and the FP8 run really rounds (its losses are not the bf16 run's), on the
CPU backend at a tiny size."""

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
def test_both_runs_start_alike_and_learn(tmp_path):
    out = tmp_path / "fp8.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_accuracy.py"), "--steps", "12", "--tokens", "64",
                    "--d", "64", "--f", "64", "--layers", "1", "--lr", "1e-2", "--out", str(out)], check=True,
                   capture_output=True)
    r = json.loads(out.read_text())
    bf16, fp8 = r["loss_bf16"], r["loss_fp8"]
    assert len(bf16) == len(fp8) == 12
    assert abs(fp8[0] - bf16[0]) < 0.05 * bf16[0]
    assert bf16 != fp8
    assert bf16[-1] < bf16[0] and fp8[-1] < fp8[0]
