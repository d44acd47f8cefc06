"""The benchmark scripts run end to end (tiny settings, CPU) and write their files."""

import json
import subprocess
import sys

from conftest import ROOT, user_env


def test_benchmark_writes_a_table_with_strict_and_fast(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "benchmark.py"),
            "--steps",
            "4",
            "--warmup",
            "2",
            "--repeats",
            "1",
            "--models",
            "convnet",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=user_env(),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("benchmark-*.json")]
    assert [(r["amp"], r["loader"]) for r in record["rows"]] == [
        ("fp32", "single"),
        ("fp32", "multi"),
        ("bf16", "single"),
        ("bf16", "multi"),
    ]
    for r in record["rows"]:
        assert r["strict_over_fast"] > 0 and r["strict_distinct_weights"] == 1
    assert "| convnet | fp32 | single |" in next(tmp_path.glob("benchmark-*.md")).read_text()
