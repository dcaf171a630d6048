"""GPU training step time: DDP's own allreduce, PyTorch's hooks and ringcomm's, side by side.

    python bench/gpu_train.py [--models resnet18,vit_s] [--ranks 2] [--batch 64]
        [--steps 20] [--warmup 5] [--json F] [--markdown F] [--profile F] [--baseline DIR]
        [--baseline-variants V,...] [--traces ZIP]

For each model, one torchrun-style job of ``--ranks`` processes (sharing the GPUs there are,
gloo between them, as torchrun sets it up) trains the same model on the same synthetic batches
once per variant: DDP with no hook (its own allreduce), PyTorch's fp16 and PowerSGD hooks, and
ringcomm's hook uncompressed (through pinned host copies, and piece by piece as before them),
with Int8, TopK and PowerSGD, and with compression="auto". ringcomm's communicator is the one
of ``ringcomm.torch.init()``, as a torchrun user gets it (MPI where the processes can join
one MPI world, else gloo; the table says which). Each variant's step time is the
median of ``--steps`` steps after ``--warmup``, with its quartiles; the parameters after
training are digested (SHA-256) on every rank: identical on all ranks, and, for uncompressed
variants, bit-identical to DDP's own.

``--baseline DIR`` runs ringcomm's variants that an earlier tree has (uncompressed, Int8, TopK)
once more with the ringcomm package of DIR (a checkout of an earlier commit), marked "[before]",
in the same run (``--baseline-variants`` picks fewer). ``--profile F`` also profiles a few
steps of DDP default and of each ringcomm variant with torch.profiler on rank 0 and writes the
operator tables to F (where the hook's time goes); ``--traces ZIP`` writes the timelines
(Chrome traces) of DDP default and of ringcomm's uncompressed hook on the first model, from
every rank, into one zip file.
``--device cpu`` and ``--models mlp`` run the same on CPU (this script's own test). Part of
bench/gpu_check.py (step ``train-bench``), which reads the ``RESULT`` lines rank 0 prints.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check_ddp  # noqa: E402  (bench/, beside this script)

# name -> (hook family, options); "ddp" is DDP with no hook.
# PyTorch's hooks run last: its PowerSGD hook, over gloo on CUDA tensors with DDP's default
# buckets, did not finish (H200, torch 2.11), so it gets one bucket, as in PyTorch's own tests.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "DDP default": ("ddp", {}),
    "ringcomm": ("ringcomm", {}),
    "ringcomm (staged whole)": ("ringcomm", {"host_staging": True}),
    "ringcomm (piece by piece)": ("ringcomm", {"host_staging": False}),
    "ringcomm Int8": ("ringcomm", {"compression": "int8"}),
    "ringcomm Int8 (host codecs)": ("ringcomm", {"compression": "int8", "host_staging": True}),
    "ringcomm Int8 (four segments a chunk)": ("ringcomm", {"compression": "int8",
                                                           "device_segments": 4}),
    "ringcomm TopK(0.01)": ("ringcomm", {"compression": "topk"}),
    "ringcomm PowerSGD(rank=1)": ("ringcomm", {"compression": "powersgd"}),
    "ringcomm auto": ("ringcomm", {"compression": "auto"}),
    "PyTorch fp16_compress_hook": ("torch-fp16", {}),
    "PyTorch PowerSGD rank 1 (one bucket)": ("torch-powersgd", {}),
}
BASELINE_VARIANTS = ("ringcomm", "ringcomm Int8", "ringcomm TopK(0.01)")
TRACED = ("DDP default", "ringcomm")  # the timelines --traces writes
PROFILE_STEPS = 3
_JOB_START = 2  # what starting a job costs, in variants' time (see launch_all)


def emit(kind: str, payload: dict[str, Any]) -> None:
    print(f"{kind} " + json.dumps(payload), flush=True)


# ----------------------------------------------------------------------------- one rank
def _model(torch: Any, name: str) -> Any:
    if name == "resnet18":
        import torchvision
        return torchvision.models.resnet18(num_classes=1000)
    if name == "vit_s":
        import timm
        return timm.create_model("vit_small_patch16_224", num_classes=1000)
    if name == "mlp":
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 256),
                                   torch.nn.ReLU(), torch.nn.Linear(256, 1000))
    raise ValueError(f"unknown model {name!r}")


def _compression(kind: Any) -> Any:
    import ringcomm
    return {"int8": ringcomm.Int8(), "topk": ringcomm.TopK(0.01),
            "powersgd": ringcomm.PowerSGD(rank=1), "auto": "auto", None: None}[kind]


def _register(torch: Any, model: Any, family: str, options: dict[str, Any]) -> Any:
    """Register the variant's comm hook; ringcomm's state (None for the others)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if family == "torch-fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif family == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif family == "ringcomm":
        from ringcomm.torch import RingcommState, ringcomm_hook

        options = dict(options)
        options.pop("device_segments", None)  # the ring's, set around the variant (_train)
        options["compression"] = _compression(options.get("compression"))
        state = RingcommState(**options)
        model.register_comm_hook(state, ringcomm_hook)
        return state
    return None


#: Steps an "auto" variant may take beyond the warmup to end its trial calls.
SETTLE_STEPS = 60


def _auto_settling(state: Any) -> bool:
    """Whether ``compression="auto"`` is still trying candidates: its trial iterations run
    compressors the job may not keep, so they are warmup, not its speed. They end at the same
    iteration on every rank (their decision is one exchange). A tree whose hook tried per call
    (no ``auto_choice``): until every bucket size has chosen."""
    if hasattr(state, "auto_choice"):
        return state.auto_choice is None
    figures = state.comm.auto_figures
    return bool(figures.trials) or not figures.choices


def _auto_choices(state: Any) -> dict[str, str]:
    """What auto chose: for all compressed buckets, or per bucket size (elements)."""
    if hasattr(state, "auto_choice"):
        return {"every compressed bucket": str(state.auto_choice)}
    return {f"{key[2]} elements": auto.key(choice)
            for key, (auto, choice) in state.comm.auto_figures.choices.items()}


def _auto_trials(state: Any) -> dict[str, Any]:
    """What the hook's trials measured: each candidate's median iteration (ms), the slowest
    rank's (what the choice compares), or this rank's where the tree keeps only its samples;
    and whose ("of")."""
    trials = getattr(state, "_trials", None)
    medians, of = getattr(trials, "slowest", None), "slowest rank's"
    if medians is None:
        medians = {k: statistics.median(v) for k, v in getattr(trials, "samples", {}).items()}
        of = "rank 0's"
    return {"ms": {k: round(1e3 * v, 2) for k, v in medians.items()}, "of": of}


def _sync(torch: Any, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _train(torch: Any, args: Any, name: str, device: str, rank: int) -> dict[str, Any]:
    """Train one variant; its step times and the digest of its parameters. A variant's
    ``device_segments`` sets the ring's segments a chunk of device arrays for its steps."""
    from ringcomm.algorithms import ring
    from ringcomm.comm import transport

    segments = VARIANTS[name][1].get("device_segments")
    # the ring's default and every backend's own (gloo sets one), where the tree has them
    owners = [ring, transport.TransportBase, *transport.TransportBase.__subclasses__()]
    saved = [(o, vars(o)[k]) for o in owners
             for k in ("DEVICE_SEGMENTS", "device_segments") if k in vars(o)]
    if segments is not None:
        for o, _ in saved:
            setattr(o, "DEVICE_SEGMENTS" if o is ring else "device_segments", segments)
    try:
        return _train_variant(torch, args, name, device, rank)
    finally:
        for o, value in saved:
            setattr(o, "DEVICE_SEGMENTS" if o is ring else "device_segments", value)


def _train_variant(torch: Any, args: Any, name: str, device: str, rank: int
                   ) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    family, options = VARIANTS[name]
    torch.manual_seed(0)
    one_bucket = {"bucket_cap_mb": 4096} if family == "torch-powersgd" else {}
    model = DDP(_model(torch, args.model).to(device), **one_bucket)
    state = _register(torch, model, family, options)
    settle = options.get("compression") == "auto"
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    side = 8 if args.model == "mlp" else 224
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    batches = [(torch.randn(args.batch, 3, side, side, device=device, generator=gen),
                torch.randint(0, 1000, (args.batch,), device=device, generator=gen))
               for _ in range(2)]

    def step(i: int) -> float:
        """One step; returns the host's time in forward (DDP's broadcast of the buffers, at
        its start, waits there for the other ranks: the rank that waits longest is ahead)."""
        x, y = batches[i % 2]
        opt.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = model(x)
        forward = time.perf_counter() - start
        torch.nn.functional.cross_entropy(out, y).backward()
        opt.step()
        return forward

    for i in range(args.warmup):
        step(i)
    settled = 0
    while settle and settled < SETTLE_STEPS and _auto_settling(state):
        step(settled)
        settled += 1
    times, forwards = [], []
    for i in range(args.steps):
        _sync(torch, device)
        start = time.perf_counter()
        forwards.append(step(i))
        _sync(torch, device)
        times.append(time.perf_counter() - start)
    _sync(torch, device)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    traced = bool(args.trace_dir) and name in TRACED and args.model == args.models[0]
    if (args.profile and family in ("ddp", "ringcomm") and rank == 0) or traced:
        _profile(torch, args, name, device, step, rank, traced)  # after the digest
    elif args.profile and family in ("ddp", "ringcomm"):
        for i in range(PROFILE_STEPS):  # the other ranks take the same steps unprofiled
            step(i)
    gc.collect()
    extra = ({"settle_steps": settled, "auto": _auto_choices(state),
              "auto_trials": _auto_trials(state)} if settle else {})
    if state is not None:  # MPI where torchrun's processes joined one MPI world, else gloo
        extra["communicator"] = state.comm.backend
    return {"times": times, "forward_ms": 1e3 * statistics.median(forwards), "digest": digest,
            "finite": bool(torch.isfinite(flat).all()), **extra}


class _Spans:
    """ringcomm's trace spans (ring phases, the hook's staging) as profiler ranges."""

    def __init__(self, torch: Any) -> None:
        import threading
        self._record = torch.autograd.profiler.record_function
        self._open = threading.local()

    def begin(self, label: str) -> None:
        ctx = self._record(label)
        ctx.__enter__()
        self._open.__dict__.setdefault("stack", []).append(ctx)

    def end(self, label: str) -> None:
        self._open.stack.pop().__exit__(None, None, None)


def _profile(torch: Any, args: Any, name: str, device: str, step: Any, rank: int,
             traced: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    from ringcomm.core import trace

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    trace.set_tracer(_Spans(torch))
    try:
        with profile(activities=activities) as prof:
            for i in range(PROFILE_STEPS):
                step(i)
            _sync(torch, device)
    finally:
        trace.set_tracer(None)
    if traced:
        slug = "".join(c if c.isalnum() else "_" for c in name).strip("_")
        slug += "_before" if args.tree else ""
        prof.export_chrome_trace(str(Path(args.trace_dir) /
                                     f"trace_{args.model}_{slug}_rank{rank}.json"))
    if not args.profile or rank != 0:
        return
    tables = [prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)]
    if device == "cuda":
        tables.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    with open(args.profile, "a") as out:
        out.write(f"## {args.model}, {name}: {PROFILE_STEPS} steps, rank 0\n\n"
                  + "\n\n".join(tables) + "\n\n")


def worker(args: Any) -> int:
    if args.tree:  # an earlier ringcomm, ahead of this tree's
        sys.path.insert(0, str(Path(args.tree).resolve()))
    import torch
    import torch.distributed as dist

    from ringcomm.core import launch

    info = launch.detect()
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        torch.backends.cudnn.benchmark = True
    dist.init_process_group("gloo", timeout=gpu_check_ddp.GROUP_TIMEOUT)
    rank = dist.get_rank()
    reference = None
    for name in [v for v in VARIANTS if v in args.variants]:
        try:
            got = _train(torch, args, name, device, rank)
            error = None
        except Exception as err:  # reported in the table; the next variant runs
            got, error = None, f"{type(err).__name__}: {err}"
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (got, error))
        if rank != 0:
            continue
        errors = sorted({e for _, e in everyone if e})
        if errors:
            emit("RESULT", {"model": args.model, "variant": name, "error": errors[0]})
            continue
        digests = {g["digest"] for g, _ in everyone}
        times = everyone[0][0]["times"]
        if name == "DDP default":
            reference = everyone[0][0]["digest"]
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        family, options = VARIANTS[name]
        emit("RESULT", {
            "model": args.model, "variant": name + (" [before]" if args.tree else ""),
            "uncompressed": family in ("ddp", "ringcomm") and "compression" not in options,
            "ringcomm": str(Path(sys.modules["ringcomm"].__file__).parent),
            "ms": 1e3 * statistics.median(times),
            "q1": 1e3 * q[0], "q3": 1e3 * q[2], "steps": len(times),
            "identical_on_ranks": len(digests) == 1,
            "finite": all(g["finite"] for g, _ in everyone),
            "same_as_ddp": None if reference is None else everyone[0][0]["digest"] == reference,
            "digest": everyone[0][0]["digest"][:16],
            "forward_ms_by_rank": [round(g["forward_ms"], 2) for g, _ in everyone],
            **{k: everyone[0][0][k] for k in ("settle_steps", "auto", "auto_trials",
                                               "communicator") if k in everyone[0][0]}})
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------- report
def table(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown report: per model, each variant's step time against DDP default's."""
    lines = [f"# GPU training step time ({meta['device']})", "",
             f"{meta['ranks']} ranks sharing {meta['gpus']}, torchrun-style, gloo between "
             f"them; torch {meta['torch']}; batch {meta['batch']} per rank; median of "
             f"{meta['steps']} steps after {meta['warmup']} (quartiles in brackets). "
             "Parameters: SHA-256 of the trained parameters, compared across ranks and with "
             "DDP default's.", ""]
    for model in dict.fromkeys(r["model"] for r in results):
        rows = [r for r in results if r["model"] == model]
        base = next((r["ms"] for r in rows if r["variant"] == "DDP default" and "ms" in r),
                    None)
        lines += [f"## {model}", "",
                  "| variant | ms/step | vs DDP default | forward, by rank | parameters |",
                  "| --- | ---: | ---: | ---: | --- |"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['variant']} | fails: `{r['error'][:160]}` | | | |")
                continue
            ratio = f"{base / r['ms']:.2f}" if base else "-"
            if not r["identical_on_ranks"] or not r["finite"]:
                params = "DIFFER between ranks" if r["finite"] else "NOT FINITE"
            elif r["uncompressed"] and r["variant"] != "DDP default":
                params = ("bit-identical to DDP default's" if r["same_as_ddp"]
                          else "differ from DDP default's")
            else:
                params = "identical on all ranks"
            over = f" (over {r['communicator']})" if "communicator" in r else ""
            forward = " / ".join(f"{f:.1f}" for f in r.get("forward_ms_by_rank", ()))
            lines.append(f"| {r['variant']}{over} | {r['ms']:.1f} [{r['q1']:.1f}-{r['q3']:.1f}] "
                         f"| {ratio} | {forward or '-'} | {params} `{r['digest']}` |")
        lines.append("")
        for r in rows:
            if "auto" in r:
                chose = ", ".join(f"{c} for {what}" for what, c in r["auto"].items())
                trials = r.get("auto_trials", {})
                tried = ", ".join(f"{c} {ms:.1f} ms" for c, ms in trials.get("ms", {}).items())
                tried = (f" Its trials' iterations ({trials['of']} median): {tried}."
                         if tried else "")
                lines += [f"- {r['variant']}: timed after its trials ended "
                          f"({r['settle_steps']} steps beyond the warmup); it chose "
                          f"{chose}.{tried}", ""]
    lines.append("vs DDP default: DDP default's step time over the variant's (above 1 is "
                 "faster). Forward, by rank: each rank's median host time in forward (ms), "
                 "where DDP's broadcast of the buffers waits for the other ranks: a rank far "
                 "above the others was ahead of them, and the step time then measures the "
                 "ranks' skew as much as the hook.")
    return "\n".join(lines) + "\n"


def _meta(args: Any) -> dict[str, Any]:
    import torch
    cuda = args.device == "cuda" and torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else "CPU"
    count = torch.cuda.device_count() if cuda else 0
    return {"device": name, "gpus": f"{count} GPU(s)" if cuda else "the CPU",
            "torch": torch.__version__, "ranks": args.ranks, "batch": args.batch,
            "steps": args.steps, "warmup": args.warmup}


def launch_all(args: Any) -> int:
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", "--device", args.device,
          "--batch", str(args.batch), "--steps", str(args.steps), "--warmup",
          str(args.warmup), "--variants", ",".join(args.variants)]
    if args.profile:
        Path(args.profile).write_text("# torch.profiler tables of ringcomm's variants\n\n")
        me += ["--profile", str(Path(args.profile).resolve())]
    if args.traces:
        args.trace_dir = tempfile.mkdtemp(prefix="ringcomm-traces-")
        me += ["--trace-dir", args.trace_dir]
    me += ["--models", ",".join(args.models)]  # the first one is traced
    results: list[dict[str, Any]] = []
    ok = True
    base = gpu_check_ddp.launcher_env()
    before = ([v for v in args.baseline_variants if v in args.variants] if args.baseline
              else [])
    jobs = []  # per model: this tree's variants, then the earlier tree's
    for model in args.models:
        jobs.append((model, [], len(args.variants)))
        if before:
            jobs.append((model, ["--tree", str(Path(args.baseline).resolve()), "--variants",
                                 ",".join(before)], len(before)))
    # Each job's share of the time: by its variants, plus two variants' worth for starting
    # (a job of one variant, the baseline's, would not start in its share otherwise).
    total = sum(expected + _JOB_START for _, _, expected in jobs)
    for model, extra, expected in jobs:
        envs = gpu_check_ddp.torchrun_envs(base, args.ranks)
        codes, texts = gpu_check_ddp.run_processes(
            [[*me, "--model", model, *extra]] * args.ranks, envs,
            args.timeout * (expected + _JOB_START) / total)
        got = [json.loads(line.split(" ", 1)[1]) for line in texts[0].splitlines()
               if line.startswith("RESULT ")]
        ddp = next((r.get("digest") for r in results
                    if r["model"] == model and r["variant"] == "DDP default"), None)
        for r in got:
            if extra and "digest" in r:  # the earlier tree's, against this run's DDP default
                r["same_as_ddp"] = r["digest"] == ddp
            print(json.dumps(r), flush=True)
        results += got
        if any(codes) or len(got) != expected:
            ok = False
            print(f"{model}{' (baseline)' if extra else ''}: exit statuses {codes}; end of "
                  f"rank 0's output:\n{texts[0][-3000:]}", flush=True)
        _write(args, results)  # after each job: a run stopped from outside keeps them
        _zip_traces(args)
    print(_write(args, results))
    if args.traces:
        shutil.rmtree(args.trace_dir, ignore_errors=True)
    return 0 if ok else 1


def _zip_traces(args: Any) -> None:
    """The timelines written so far, into the zip file ``--traces`` names."""
    if not args.traces:
        return
    with zipfile.ZipFile(args.traces, "w", zipfile.ZIP_DEFLATED) as z:
        for trace in sorted(Path(args.trace_dir).glob("trace_*.json")):
            z.write(trace, trace.name)


def _write(args: Any, results: list[dict[str, Any]]) -> str:
    meta = _meta(args)
    report = table(results, meta)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(report)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet18,vit_s", help="resnet18, vit_s (timm), mlp")
    p.add_argument("--model", default="resnet18", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", type=int, default=64, help="per rank")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated names of VARIANTS (default: all)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--timeout", type=float, default=540, help="seconds for all models")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--profile", default=None, help="file for the profiler's tables")
    p.add_argument("--baseline", default=None,
                   help="a tree whose ringcomm runs the variants it has once more")
    p.add_argument("--baseline-variants", default=",".join(BASELINE_VARIANTS),
                   help="which of the variants the --baseline tree runs")
    p.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    p.add_argument("--traces", default=None, help="zip file for the Chrome traces")
    p.add_argument("--trace-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    args.baseline_variants = [v for v in args.baseline_variants.split(",") if v]
    unknown = [v for v in args.variants + args.baseline_variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    args.models = [m for m in args.models.split(",") if m]
    return worker(args) if args.worker else launch_all(args)


if __name__ == "__main__":
    sys.exit(main())
