"""PyTorch adapters in one process: tensor views, the engine, Horovod's rules, argument checks."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ringcomm  # noqa: E402
import ringcomm.torch as hvd  # noqa: E402
from ringcomm.torch._engine import Engine  # noqa: E402
from ringcomm.torch._residuals import ResidualLayouts  # noqa: E402
from ringcomm.torch._tensors import Operand, as_array  # noqa: E402
from ringcomm.torch.compression import RingCompressor, as_compression  # noqa: E402
from ringcomm.torch.horovod._reduce import parse_op, scale_  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()


def test_import_ringcomm_alone_does_not_import_torch(subprocess_env):
    code = "import ringcomm, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], env=subprocess_env, check=True, timeout=60)


def test_public_names():
    horovod_core = ["init", "shutdown", "size", "rank", "local_rank", "local_size", "allreduce",
                    "allreduce_", "allreduce_async", "allreduce_async_", "synchronize", "poll",
                    "allgather", "allgather_async", "broadcast", "broadcast_",
                    "broadcast_async", "broadcast_async_", "broadcast_parameters",
                    "broadcast_optimizer_state", "broadcast_object", "allgather_object",
                    "Compression", "DistributedOptimizer", "Average", "Sum", "Adasum", "Min",
                    "Max", "Product", "RingcommState", "ringcomm_hook"]
    for name in horovod_core:
        assert name in hvd.__all__ and hasattr(hvd, name), name
    assert hvd.Average == 0 and hvd.Sum == 1 and hvd.Adasum == 2  # Horovod's values


def test_cpu_tensors_are_viewed_not_copied():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    a = as_array(t)
    assert np.shares_memory(a, t.numpy())
    a[0, 0] = 42
    assert t[0, 0] == 42
    strided = t.t()
    assert as_array(strided).strides == (4, 12)
    op = Operand(t)
    assert not op.widened and np.shares_memory(op.array, a)


@pytest.mark.parametrize(("dtype", "wide", "tag"), [
    (torch.bool, np.int32, 1), (torch.uint8, np.int32, 2), (torch.int8, np.int32, 3),
    (torch.int16, np.int32, 4), (torch.bfloat16, np.float32, 5)])
def test_widened_dtypes_carry_their_dtype_and_write_back(dtype, wide, tag):
    t = torch.ones(2, 3, dtype=dtype)
    op = Operand(t)
    assert op.widened and op.array.dtype == wide and op.array.shape == (2, 3) + (1,) * tag
    op.array[...] = 0
    op.write_back()
    assert not t.any()


def test_engine_keeps_order_errors_and_runs_inline_when_idle():
    engine = Engine("test-engine")
    seen = []
    gate = threading.Event()
    first = engine.submit(lambda: (gate.wait(5), seen.append(1)))
    failing = engine.submit(lambda: 1 / 0)
    third = engine.submit(lambda: seen.append(3) or "done")
    assert not first.done()
    gate.set()
    assert third.wait() == "done" and seen == [1, 3]
    with pytest.raises(ZeroDivisionError):
        failing.wait()
    assert engine.run(threading.current_thread) is threading.current_thread()
    handle = engine.execute(lambda: 1 / 0, overlap=False)
    assert handle.done()
    with pytest.raises(ZeroDivisionError):
        handle.wait()
    engine.close()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit(lambda: None)


def test_scaling_follows_horovod():
    ints = torch.tensor([7, -7, 3], dtype=torch.int32)
    assert scale_(ints.clone(), 0.5).tolist() == [3, -3, 1]  # float64, truncated toward 0
    half = torch.tensor([1000.0, 3.0], dtype=torch.float16)
    expected = (half.float() * 0.1).half()
    assert torch.equal(scale_(half.clone(), 0.1), expected)  # float32, rounded once
    assert scale_(torch.tensor([True, False]), 0.0).tolist() == [False, False]


def test_op_resolution():
    assert parse_op(None, None) is hvd.Average
    assert parse_op(hvd.Max, None) is hvd.Max
    with pytest.warns(DeprecationWarning, match="average"):
        assert parse_op(None, False) is hvd.Sum
    with pytest.raises(ValueError, match="The op parameter supersedes average"):
        parse_op(hvd.Sum, True)
    with pytest.raises(ValueError, match="unknown op 9"):
        parse_op(9, None)
    with pytest.raises(NotImplementedError, match="Adasum is not supported"):
        parse_op(hvd.Adasum, None)


def test_residuals_move_with_their_tensors():
    ef = ringcomm.ErrorFeedback()
    layouts = ResidualLayouts(ef)
    like5 = np.zeros(5, np.float32)
    layouts.align("b0", (("a", 0, 3), ("b", 3, 2)), like5)
    ef.take("b0", like5)[:] = [1, 2, 3, 4, 5]
    # Re-cut: b0 now holds b alone, b1 holds a and a new tensor c.
    layouts.align("b0", (("b", 0, 2),), np.zeros(2, np.float32))
    np.testing.assert_array_equal(ef.residual("b0"), [4, 5])
    assert layouts.pending() == 1  # a waits for its new buffer
    layouts.align("b1", (("c", 0, 1), ("a", 1, 3)), np.zeros(4, np.float32))
    np.testing.assert_array_equal(ef.residual("b1"), [0, 1, 2, 3])
    np.testing.assert_array_equal(layouts.piece("a"), [1, 2, 3])
    assert layouts.pending() == 0 and layouts.piece("zz") is None


def test_residuals_of_collected_tensors_are_dropped():
    """A watched tensor's residual goes with it, wherever it is kept (in a buffer's residual, or
    stashed after a re-cut), so a new tensor that takes its key (an id() freed with it) starts
    from nothing, as the DDP hook's parameters must (a new model's parameter held a dead one's
    residual before)."""
    ef = ringcomm.ErrorFeedback()
    layouts = ResidualLayouts(ef)
    a, b, c = torch.zeros(3), torch.zeros(2), torch.zeros(1)
    ka, kb, kc = "a", "b", "c"  # the keys the tensors go by (ids, in the DDP hook)
    for key, t in ((ka, a), (kb, b), (kc, c)):
        layouts.watch(key, t)
    layouts.align("b0", ((ka, 0, 3), (kb, 3, 2)), np.zeros(5, np.float32))
    ef.take("b0", np.zeros(5, np.float32))[:] = [1, 2, 3, 4, 5]
    layouts.align("b1", ((kc, 0, 1),), np.zeros(1, np.float32))
    ef.take("b1", np.zeros(1, np.float32))[:] = [7]
    layouts.align("b1", ((kb, 0, 2),), np.zeros(2, np.float32))  # c stashed, b moved
    del a, c, t
    gc.collect()
    assert layouts.piece(ka) is None and layouts.piece(kc) is None
    np.testing.assert_array_equal(layouts.piece(kb), [4, 5])
    assert layouts.pending() == 0
    # New tensors under the freed keys, in a new cut: nothing of a's or c's comes back.
    layouts.align("b0", ((kc, 0, 1), (ka, 1, 3)), np.zeros(4, np.float32))
    assert ef.residual("b0") is None or not ef.residual("b0").any()
    np.testing.assert_array_equal(ef.residual("b1"), [4, 5])


def test_compression_names():
    assert isinstance(hvd.Compression.int8, RingCompressor)
    assert isinstance(hvd.Compression.int8.ring, ringcomm.Int8)
    assert hvd.Compression.int8.error_feedback and not hvd.Compression.fp16.error_feedback
    topk = hvd.Compression.topk(0.05)
    assert topk.ring.ratio == 0.05 and topk.error_feedback
    assert as_compression(None) is hvd.Compression.none
    wrapped = as_compression(ringcomm.BF16())
    assert isinstance(wrapped.ring, ringcomm.BF16) and not wrapped.error_feedback
    t = torch.ones(3)
    assert hvd.Compression.none.compress(t) == (t, None)
    with pytest.raises(TypeError, match=r"compression must be hvd\.Compression"):
        as_compression("int8")
    with pytest.raises(ValueError, match="ratio must be in"):
        hvd.Compression.topk(0.0)


class _Comm:
    """Stands for an mpi4py communicator (all ProcessSet looks at)."""

    def Get_rank(self) -> int:
        return 0


def test_unsupported_features_say_why():
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(torch.ones(2), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="elastic training is not supported"):
        hvd.elastic.run(lambda: None)
    with pytest.raises(NotImplementedError, match="give the list of its global ranks"):
        hvd.ProcessSet(_Comm())


def test_process_set_arguments():
    with pytest.raises(ValueError, match="must be a ProcessSet, got object"):
        hvd.allreduce(torch.ones(2), process_set=object())
    with pytest.raises(ValueError, match="ranks must be integers"):
        hvd.ProcessSet([0, "1"])
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(2), process_set=hvd.ProcessSet([0]))


def test_not_initialized_is_horovods_error(subprocess_env):
    code = ("import ringcomm.torch as hvd\n"
            "try:\n    hvd.rank()\nexcept ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert "has not been initialized; use hvd.init()" in out


def test_size_one_collectives():
    t = torch.arange(4.0)
    assert hvd.size() >= 1
    if hvd.size() != 1:
        pytest.skip("a one-process check")
    assert torch.equal(hvd.allreduce(t), t) and torch.equal(hvd.allgather(t), t)
    handle = hvd.allreduce_async(t, op=hvd.Sum, postscale_factor=2.0)
    assert torch.equal(hvd.synchronize(handle), 2 * t) and hvd.poll(handle)
    assert hvd.broadcast_object("x", root_rank=0) == "x"


def named_model():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def test_distributed_optimizer_bad_use():
    model = named_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.named_parameters())
    with pytest.raises(ValueError, match=r"must be unique\. Found duplicates: w"):
        hvd.DistributedOptimizer(opt, [("w", p) for _, p in params])
    with pytest.raises(ValueError, match="one or more model parameters were not named"):
        hvd.DistributedOptimizer(opt, params[:2])
    with pytest.raises(ValueError, match="should be a sequence of tuples"):
        hvd.DistributedOptimizer(opt, [p for _, p in params])
    with pytest.raises(ValueError, match="backward_passes_per_step must be an integer >= 1"):
        hvd.DistributedOptimizer(opt, params, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op"):
        hvd.DistributedOptimizer(opt, params, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.DistributedOptimizer(opt, params, op=hvd.Adasum)


def test_distributed_optimizer_keeps_class_state_and_options():
    model = named_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.003, betas=(0.8, 0.9))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    assert isinstance(dopt, torch.optim.Adam) and type(dopt).__name__ == "Adam"
    assert dopt.param_groups[0]["betas"] == (0.8, 0.9) and dopt.defaults["lr"] == 0.003
    assert all(int(dopt.state[p]["step"]) == 1 for p in model.parameters())
    dopt.step()
    assert all(int(dopt.state[p]["step"]) == 2 for p in model.parameters())


@pytest.mark.gpu
def test_cuda_tensors_are_viewed_through_dlpack():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    cupy = pytest.importorskip("cupy")
    t = torch.arange(6, dtype=torch.float32, device="cuda")
    a = as_array(t)
    assert isinstance(a, cupy.ndarray) and a.data.ptr == t.data_ptr()
    a[0] = 42
    torch.cuda.synchronize()
    assert t[0].item() == 42
    assert Operand(t.to(torch.bfloat16)).widened
    if hvd.size() == 1:
        assert torch.equal(hvd.allreduce(t), t)


@pytest.mark.parametrize("call", [lambda: parse_op(hvd.Adasum, None), lambda: hvd.elastic.run,
                                  lambda: hvd.ProcessSet(_Comm())])
def test_refusals_are_logged(call, caplog):
    """Every NotImplementedError of an unsupported feature is also a DEBUG record, which
    tells a test that passed on an unsupported call from one that passed on its merits."""
    with caplog.at_level(logging.DEBUG, logger="ringcomm.torch.unsupported"):
        with pytest.raises(NotImplementedError) as info:
            call()
    assert [r.getMessage() for r in caplog.records] == [f"not supported: {info.value}"]


@pytest.mark.parametrize("name, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_cast_compressors_compress_as_horovods(name, dtype):
    """Called directly, fp16/bf16 cast floating tensors (Horovod's compress/decompress), so a
    compressor of one's own can wrap them; integers pass unchanged."""
    comp = getattr(hvd.Compression, name)
    x = torch.linspace(-2, 2, 7, dtype=torch.float32)
    small, ctx = comp.compress(x)
    assert small.dtype == dtype and ctx == torch.float32
    back = comp.decompress(small, ctx)
    assert back.dtype == torch.float32 and torch.equal(back, x.to(dtype).to(torch.float32))
    ints = torch.arange(5)
    same, ctx = comp.compress(ints)
    assert same is ints and comp.decompress(same, ctx) is ints
    assert as_compression(getattr(ringcomm, name.upper())()).compress(x)[0].dtype == dtype


def test_horovod_compression_takes_an_auto():
    """hvd's DistributedOptimizer and collectives take a ringcomm.Auto as they take a ringcomm
    compressor: run by the ring, with error feedback."""
    import ringcomm
    from ringcomm.torch.compression import RingCompressor, as_compression, ring_of

    mine = ringcomm.Auto((None, ringcomm.Int8()))
    wrapped = as_compression(mine)
    assert isinstance(wrapped, RingCompressor) and wrapped.ring is mine
    assert wrapped.error_feedback and ring_of(wrapped) is mine


def test_ringcomm_state_takes_auto_as_comm_allreduce_does():
    """RingcommState(compression="auto") is ringcomm.Auto(); another string is refused, naming
    what it got and what it takes."""
    import ringcomm
    from ringcomm.torch import RingcommState

    assert isinstance(RingcommState(compression="auto").compression, ringcomm.Auto)
    # An Auto of the user's own candidates, as comm.allreduce(compression=Auto(...)) takes it.
    mine = ringcomm.Auto((None, ringcomm.Int8()))
    assert RingcommState(compression=mine).compression is mine
    with pytest.raises(TypeError, match=r"\"auto\" or hvd.Compression.<name>, got 'int8'"):
        RingcommState(compression="int8")


def test_elastic_is_a_module_that_says_what_to_do_instead():
    import importlib

    elastic = importlib.import_module("ringcomm.torch.elastic")
    assert hvd.elastic is elastic
    for name in ("run", "State", "ObjectState", "TorchState", "ElasticSampler"):
        assert not hasattr(hvd.elastic, name)  # feature detection sees no elastic support
        with pytest.raises(NotImplementedError, match="restart a job that lost a rank"):
            getattr(hvd.elastic, name)
    with pytest.raises(ImportError, match=r"cannot import name 'TorchState' from "
                                          r"'ringcomm.torch.elastic'"):
        exec("from ringcomm.torch.elastic import TorchState", {})
    assert elastic.ElasticUnsupportedError.__mro__[1:3] == (NotImplementedError, RuntimeError)


def test_without_torch_the_error_names_the_extra():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n    import ringcomm.torch\n"
            "except ModuleNotFoundError as err:\n    print(err.name, '|', err)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    name, message = run.stdout.strip().split(" | ", 1)
    assert name == "torch" and "pip install 'ringcomm[torch]'" in message, run.stdout
