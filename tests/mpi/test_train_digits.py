"""The digits example, shortened: compressed training keeps the accuracy of dense training."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def accuracy(comm, example):
    """Final test accuracy per compression (12 epochs, global batch 64)."""
    pytest.importorskip("sklearn")
    if 64 % comm.size:
        pytest.skip(f"the global batch of 64 does not split over {comm.size} ranks")
    results = {}
    for compression in ("none", "int8", "topk"):
        args = example.parse_args(["--compression", compression, "--epochs", "12"])
        results[compression] = example.train(comm, args, log=lambda *_: None)
    return results


@pytest.mark.timeout(300)
def test_dense_training_learns(accuracy):
    assert accuracy["none"].final_accuracy > 0.95


@pytest.mark.timeout(300)
def test_int8_within_one_point_of_dense(accuracy):
    assert accuracy["int8"].final_accuracy >= accuracy["none"].final_accuracy - 0.01


@pytest.mark.timeout(300)
def test_topk_within_two_points_of_dense(accuracy):
    assert accuracy["topk"].final_accuracy >= accuracy["none"].final_accuracy - 0.02


@pytest.mark.timeout(300)
def test_compression_moves_fewer_bytes(comm, accuracy):
    if comm.size == 1:
        pytest.skip("nothing goes on the wire in a single process")
    wire = {k: r.epochs[-1]["wire_bytes_per_step"] for k, r in accuracy.items()}
    assert wire["int8"] < wire["none"] / 2.5
    assert wire["topk"] < wire["int8"]
