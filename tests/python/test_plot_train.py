"""benchmarks/plot_train.py: its bars are the benchmarks' timings (the
tuned_wide store rows beside torch's step and the roof), the bursts by
default and the steady state with --steady, which it refuses by name where
the files hold no steady timings."""

import json
import pathlib
import re
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "plot_train.py"


def write_results(folder, steady):
    def ours(memory, schedule, real_time):
        row = {"name": f"train/mixtral/uniform/{schedule}/{memory}/iterations:2/manual_time",
               "real_time": real_time, "TFLOPs": 600.0, "roof_TFLOPs": 700.0, "ratio": 600.0 / 700.0}
        if steady:
            row.update(steady_ms=real_time + 1.1, ratio_steady=0.867)
        return row

    # Only tuned_wide's store row is drawn: the lean and megablocks rows are
    # there to be left out.
    rows = [ours("store", "tuned_wide", 28.11), ours("lean", "tuned_wide", 99.0), ours("store", "megablocks", 77.0)]
    torch = {"shape": "mixtral", "routing": "uniform", "ms": 29.37}
    if steady:
        torch["steady_ms"] = 30.66
    (folder / "train.json").write_text(json.dumps({"benchmarks": rows}))
    (folder / "torch_train.json").write_text(json.dumps({"results": [torch]}))


def plot(folder, *flags):
    return subprocess.run([sys.executable, str(SCRIPT), str(folder), *flags], capture_output=True, text=True)


def bar_labels(folder):
    return re.findall(r">([0-9.]+(?: TFLOP/s)?)</text>", (folder / "train.svg").read_text())


def test_the_bursts_by_default(tmp_path):
    write_results(tmp_path, steady=True)
    r = plot(tmp_path)
    assert r.returncode == 0, r.stderr
    # ours, torch, the roof (ours x our TFLOP/s / the roof's), our TFLOP/s
    assert bar_labels(tmp_path) == ["28.1", "29.4", "24.1", "600 TFLOP/s"]
    assert "at the steady state" not in (tmp_path / "train.svg").read_text()


def test_the_steady_state_with_steady(tmp_path):
    write_results(tmp_path, steady=True)
    r = plot(tmp_path, "--steady")
    assert r.returncode == 0, r.stderr
    # ours 29.21, torch 30.66, the roof 29.21 x 0.867 = 25.3, 600 x 28.11 / 29.21 TFLOP/s
    assert bar_labels(tmp_path) == ["29.2", "30.7", "25.3", "577 TFLOP/s"]
    assert "Training step at the steady state" in (tmp_path / "train.svg").read_text()


def test_steady_without_steady_timings_is_refused(tmp_path):
    write_results(tmp_path, steady=False)
    r = plot(tmp_path, "--steady")
    assert r.returncode == 1
    assert "--steady needs the steady-state timings in both files" in r.stderr
    assert not (tmp_path / "train.svg").exists()
