"""bench/codecs_perf.py runs end to end on a small array: every codec row is measured and the
compiled output is the reference's, bit for bit (the benchmark's own check)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(300)


def test_codecs_perf_small_run(tmp_path):
    spec = importlib.util.spec_from_file_location("codecs_perf", ROOT / "bench/codecs_perf.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["codecs_perf"] = module
    spec.loader.exec_module(module)
    out = tmp_path / "codecs"
    assert module.main(["--sizes", "256K", "-n", "2", "-w", "1", "--no-compile-cost",
                        "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    rows = result["sizes"][0]["rows"]
    assert {r["codec"] for r in rows} >= {"int8 encode", "int8 hop (fused)", "fp16 encode",
                                           "bf16 hop + error", "top-k 0.01 exact"}
    assert all(r["same"] for r in rows), [r["codec"] for r in rows if not r["same"]]
    assert all(r["numba_ms"] > 0 for r in rows)
