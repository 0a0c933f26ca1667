"""benchmarks/fp8_accuracy.py: the bf16 and the FP8 runs start from the same
weights and batches (their first losses agree to FP8's error), both learn,
and the FP8 run really rounds (its losses are not the bf16 run's), on the
CPU backend at a tiny size."""

import json
import math
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


@pytest.mark.skipif(not mf.has_cpu_backend, reason="no CPU backend")
def test_several_seeds_with_a_perturbed_bf16_run(tmp_path):
    # Per seed three runs; the perturbed one starts from weights one bf16
    # rounding away, so its losses differ from bf16's but barely at first.
    out = tmp_path / "seeds.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_accuracy.py"), "--steps", "4", "--tokens", "32",
                    "--d", "32", "--f", "64", "--layers", "1", "--seeds", "2", "--perturbed", "--out", str(out)],
                   check=True, capture_output=True)
    r = json.loads(out.read_text())
    assert [s["seed"] for s in r["seeds"]] == [1, 2]
    for s in r["seeds"]:
        bf16, moved = s["losses"]["bf16"], s["losses"]["bf16_perturbed"]
        assert bf16 != moved
        assert abs(moved[0] - bf16[0]) < 0.01 * bf16[0]
    # Different seeds draw different weights and batches.
    assert r["seeds"][0]["losses"]["bf16"][0] != r["seeds"][1]["losses"]["bf16"][0]
    assert set(r["summary"]) == {"e4m3", "bf16_perturbed"}


@pytest.mark.skipif(not mf.has_cpu_backend, reason="no CPU backend")
def test_the_classification_task_has_a_floor_and_learns_towards_it(tmp_path):
    # Labels drawn from the teacher's softmax: the loss starts near ln C and
    # stays above the labels' entropy, which the JSON reports.
    out = tmp_path / "classify.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_accuracy.py"), "--task", "classify", "--classes",
                    "16", "--steps", "20", "--tokens", "64", "--d", "32", "--f", "64", "--layers", "1", "--lr", "1e-2",
                    "--seeds", "2", "--out", str(out)], check=True, capture_output=True)
    r = json.loads(out.read_text())
    floor = r["label_entropy"]
    assert 0 < floor < math.log(16)
    for s in r["seeds"]:
        bf16 = s["losses"]["bf16"]
        assert abs(bf16[0] - math.log(16)) < 0.5
        assert min(bf16) > 0.5 * floor
        assert sum(bf16[-5:]) / 5 < sum(bf16[:5]) / 5
