"""`tether demo`, the README's main job, end to end as a user runs it."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_runs_a_model_on_a_local_farm_and_matches_onnxruntime():
    env = {**os.environ, "PYTHONPATH": ROOT}
    result = subprocess.run([sys.executable, "-m", "remote.cli", "demo", "--runs", "3"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "one device server with key 'local'" in out
    assert "onnxruntime gives the same classes" in out and "(match)" in out
    assert "latency on the device over 3 repeats" in out
    assert out.rstrip().endswith("demo finished: the farm is stopped.")
