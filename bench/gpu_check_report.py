"""The GPU check's report: reading each step's output, and writing the JSON and Markdown files.

Part of bench/gpu_check.py. The JSON (``gpu_check.json``) holds everything; the Markdown
(``gpu_check.md``) is its summary for people: machine, versions, one row per step, failures,
skip reasons, and the kernel benchmark's table. bench/GPU.md describes both.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = [
    "COUNT_KEYS",
    "SCHEMA",
    "STATUSES",
    "markdown",
    "parse_checks",
    "parse_pytest",
    "step_status",
    "summary",
    "variant_rows",
    "write_report",
]

#: Name and version of the report's layout; a change of its keys changes the version.
SCHEMA = "ringcomm-gpu-check/1"
#: A step's status: pending (not reached yet, in a report written mid-run), then one of the rest.
STATUSES = ("pending", "passed", "failed", "timeout", "skipped", "error", "interrupted")
#: The counts a step reports (tests, or checks for ddp-cuda, or 1 for the benchmark).
COUNT_KEYS = ("passed", "failed", "skipped", "error", "xfailed", "xpassed", "deselected")
_BAD = ("failed", "timeout", "error", "interrupted")

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b")
_TIME = re.compile(r"\bin [\d.]+s\b")
_SKIP = re.compile(r"^SKIPPED \[(\d+)\] (?:[^:]+:\d+: )?(.*)$")
_CHECK = re.compile(r"^CHECK (\{.*\})\s*$")


def parse_pytest(text: str) -> tuple[dict[str, int], list[str], list[dict[str, Any]]]:
    """Counts, failure lines and skip reasons from pytest's output (or tests/run_mpi.py's).

    The counts come from the last summary line ("3 passed, 1 skipped in 2.0s"): run_mpi.py
    ends with one over all its jobs. Failures are the ``FAILED``/``ERROR`` lines of ``-rfE``,
    skip reasons the ``SKIPPED [n]`` lines of ``-rs``, counted by reason.
    """
    counts: dict[str, int] = {}
    failures: list[str] = []
    reasons: Counter[str] = Counter()
    for line in text.splitlines():
        stripped = line.strip().strip("=").strip()
        if _TIME.search(stripped) and (_COUNT.search(stripped) or "no tests ran" in stripped):
            counts = {}
            for num, kind in _COUNT.findall(stripped):
                key = "error" if kind.startswith("error") else kind
                counts[key] = counts.get(key, 0) + int(num)
        elif line.startswith(("FAILED ", "ERROR ")) and line not in failures:
            failures.append(line.strip())
        else:
            m = _SKIP.match(line.strip())
            if m:
                reasons[m.group(2).strip()] += int(m.group(1))
    skips = [{"count": n, "reason": r} for r, n in reasons.most_common()]
    return counts, failures[:50], skips[:30]


def parse_checks(text: str) -> tuple[dict[str, int], list[str], list[dict[str, Any]]]:
    """Counts, failures and skips from the ``CHECK {...}`` lines of bench/gpu_check_ddp.py."""
    counts: dict[str, int] = {}
    failures: list[str] = []
    skips: list[dict[str, Any]] = []
    for line in text.splitlines():
        m = _CHECK.match(line.strip())
        if not m:
            continue
        try:
            check = json.loads(m.group(1))
            status, name, detail = check["status"], check["name"], check.get("detail", "")
        except (ValueError, KeyError, TypeError):
            continue
        counts[status] = counts.get(status, 0) + 1
        if status == "failed":
            failures.append(f"{name}: {detail}")
        elif status == "skipped":
            skips.append({"count": 1, "reason": f"{name}: {detail}"})
    return counts, failures, skips


def step_status(rc: int | None, timed_out: bool, counts: dict[str, int],
                timeout: float) -> tuple[str, str]:
    """A step's status and the reason, from its exit status and counts.

    Passed: something passed and nothing failed, exit status 0. Skipped: everything skipped
    (run_mpi.py exits 1 then, which is not a failure). Failed: a failure or error, or an exit
    status that no count explains.
    """
    if timed_out:
        return "timeout", f"stopped after {timeout:.0f} s"
    bad = counts.get("failed", 0) + counts.get("error", 0)
    if bad:
        return "failed", f"{bad} failed"
    if counts.get("passed"):
        return ("passed", "") if rc == 0 else ("failed", f"exit status {rc}")
    if counts.get("skipped"):
        return "skipped", "every test skipped (see the reasons)"
    if not counts:
        return "failed", f"exit status {rc}, no summary in the output"
    return "failed", f"exit status {rc}, nothing passed"


def summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Which steps ran, passed, failed and were skipped; the totals; whether all is well."""
    ran = [s["name"] for s in steps if s["status"] not in ("pending", "skipped")]
    failed = [s["name"] for s in steps if s["status"] in _BAD]
    totals: dict[str, int] = {}
    for s in steps:
        for key, n in s.get("counts", {}).items():
            totals[key] = totals.get(key, 0) + n
    return {"ran": ran, "passed": [s["name"] for s in steps if s["status"] == "passed"],
            "failed": failed, "skipped": [s["name"] for s in steps if s["status"] == "skipped"],
            "pending": [s["name"] for s in steps if s["status"] == "pending"],
            "totals": totals, "ok": bool(ran) and not failed}


def write_report(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write ``gpu_check.json`` and ``gpu_check.md`` under ``out``, each replaced whole."""
    out.mkdir(parents=True, exist_ok=True)
    paths = (out / "gpu_check.json", out / "gpu_check.md")
    for path, text in zip(paths, (json.dumps(report, indent=2) + "\n", markdown(report)),
                          strict=True):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return paths


# ------------------------------------------------------------------------------ Markdown
def _cuda_version(code: Any) -> str:
    """13020 -> "13.2"; anything else as it is."""
    return f"{code // 1000}.{code % 1000 // 10}" if isinstance(code, int) and code > 0 else "-"


def _answer(section: dict[str, Any], key: str) -> str:
    if "error" in section:
        return f"unavailable ({section['error']})"
    value = section.get(key)
    return "-" if value is None else str(value)


def _machine_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    host, probe = report.get("machine", {}), report.get("probe", {})
    cupy, torch = probe.get("cupy", {}), probe.get("torch", {})
    gpus = "; ".join(f"{g['name']} ({g['memory_mib']} MiB, driver {g['driver']}, "
                     f"compute {g['compute_cap']})" for g in host.get("gpus", []))
    stack, nccl = probe.get("stack", {}), probe.get("nccl", {})
    src = report.get("source", {})
    return [
        ("GPU", gpus or f"none: {report.get('gpu', {}).get('reason') or '-'}"),
        ("host", f"{host.get('host')}, {host.get('cpus')} CPUs, {host.get('platform')}"),
        ("Python", f"{probe.get('python', {}).get('version', '-')} "
                   f"({report.get('python', '-')})"),
        ("CuPy / CUDA", f"CuPy {_answer(cupy, 'version')}, runtime "
                        f"{_cuda_version(cupy.get('runtime'))}, driver "
                        f"{_cuda_version(cupy.get('driver'))}, NVRTC "
                        f"{_answer(probe.get('nvrtc', {}), 'version')}"),
        ("CUDA stack", f"CUDA {stack.get('cuda_major', '-')} (from {stack.get('source', '-')}):"
                       f" extra {stack.get('extra', '-')}; headers {stack.get('headers', '-')}"
                       if "error" not in stack else _answer(stack, "")),
        ("NCCL", f"{_answer(nccl, 'version')} ({nccl.get('path', '-')})"),
        ("PyTorch", f"{_answer(torch, 'version')}, CUDA {torch.get('cuda', '-')}, "
                    f"available: {torch.get('cuda_available', '-')}"),
        ("MPI", f"{_answer(probe.get('mpi', {}), 'library')}; mpiexec "
                f"{report.get('mpi', {}).get('mpiexec') or 'none'}"),
        ("kernel sources", "readable" if "error" not in probe.get("kernels", {"error": "-"})
         else _answer(probe.get("kernels", {}), "")),
        ("source", f"{src.get('commit') or 'unknown commit'}"
                   f"{' with local changes' if src.get('dirty') else ''}"),
        ("carried wheels", ", ".join(report.get("setup", {}).get("wheels", [])) or "none"),
    ]


def _steps_table(steps: list[dict[str, Any]]) -> list[str]:
    lines = ["| step | status | passed | failed | skipped | errors | time (s) | note |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for s in steps:
        c = s.get("counts", {})
        note = (s.get("reason") or "").replace("|", "\\|").replace("\n", " ")[:300]
        lines.append(f"| {s['name']} | {s['status']} | {c.get('passed', 0)} | "
                     f"{c.get('failed', 0)} | {c.get('skipped', 0)} | {c.get('error', 0)} | "
                     f"{s.get('duration_s') if s.get('duration_s') is not None else '-'} | "
                     f"{note} |")
    return lines


def _bench_table(bench: dict[str, Any]) -> list[str]:
    dev = bench.get("device", {})
    lines = [f"{dev.get('name', '?')}, {bench.get('elements')} float32 elements, median of "
             f"{bench.get('iters')} runs; GB/s counts bytes read and written.", "",
             "| kernel | bytes | time (us) | GB/s | of copy |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in bench.get("results", []):
        gbps = f"{r['gbps']:.1f}" if r.get("gbps") is not None else "-"
        frac = f"{r['of_copy']:.0%}" if r.get("of_copy") is not None else "-"
        lines.append(f"| {r['kernel']} | {r.get('bytes') or '-'} | {r['us']:.1f} | {gbps} | "
                     f"{frac} |")
    return lines


# A variant row of the kernel benchmark: "<default>, <variant> <k=...> [work]", beside its
# default's "<default> <k=...> [work]".
_VARIANT = re.compile(r"^(?P<base>[^,\[]+?), (?P<variant>[^\[]+?) (?P<arg>k=\d+)")
_ARG = re.compile(r"^(?P<base>[^,\[]+?) (?P<arg>k=\d+)")


def variant_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each variant row of the kernel benchmark against its default row: the default's time
    over the variant's (above 1: the variant is faster), and, for top-k rows, torch.topk's time
    over the variant's, where the benchmark timed torch.topk."""
    times: dict[str, float] = {}
    for r in results:
        match = _ARG.match(r["kernel"])
        if match and not r["kernel"].startswith(" "):
            times.setdefault(f"{match['base']} {match['arg']}", r["us"])
    rows = []
    for r in results:
        match = _VARIANT.match(r["kernel"])
        default = times.get(f"{match['base']} {match['arg']}") if match else None
        if match is None or default is None or not r["us"]:
            continue
        torch = times.get(f"torch.topk {match['arg']}")
        rows.append({"default": f"{match['base']} {match['arg']}", "variant": match["variant"],
                     "default_us": default, "us": r["us"], "speedup": default / r["us"],
                     "vs_torch_topk": torch / r["us"]
                     if torch and match["base"].startswith("topk") else None})
    return rows


def _variant_table(results: list[dict[str, Any]]) -> list[str]:
    rows = variant_rows(results)
    if not rows:
        return []
    lines = ["", "### Variants against their default", "",
             "Each variant (a switch in ringcomm.ops) timed beside its default in the same run; "
             "above 1: the variant is faster.", "",
             "| default | variant | default (us) | variant (us) | default / variant | "
             "torch.topk / default | torch.topk / variant |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        torch = r["vs_torch_topk"]
        before = "-" if torch is None else f"{torch * r['us'] / r['default_us']:.2f}x"
        after = "-" if torch is None else f"{torch:.2f}x"
        lines.append(f"| {r['default']} | {r['variant']} | {r['default_us']:.1f} | "
                     f"{r['us']:.1f} | {r['speedup']:.2f} | {before} | {after} |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The report for people: what ran where, and how it went."""
    summ = report.get("summary", {})
    verdict = "all steps that ran passed" if summ.get("ok") else (
        "failed: " + ", ".join(summ.get("failed", [])) if summ.get("failed") else "nothing ran")
    out = [f"# ringcomm GPU check: {verdict}", "",
           f"Started {report.get('started')}, finished {report.get('finished') or '(running)'}"
           f", {report.get('duration_s') or '-'} s. Command: `{report.get('command')}`.", "",
           "## Machine", "", "| | |", "| --- | --- |"]
    out += [f"| {k} | {v} |".replace("\n", " ") for k, v in _machine_rows(report)]
    for problem in report.get("setup", {}).get("problems", []):
        out += ["", f"**Set-up problem:** {problem}"]
    versions = report.get("probe", {}).get("versions", {})
    if versions and "error" not in versions:
        out += ["", "## Versions", "", "| distribution | version |", "| --- | --- |"]
        out += [f"| {d} | {v or 'not installed'} |" for d, v in versions.items()]
    steps = report.get("steps", [])
    out += ["", "## Steps", "", *_steps_table(steps), ""]
    out += [f"- **{s['name']}**: {s['what']} (`{s['command']}`)" for s in steps]
    for s in steps:
        if s.get("failures") or s["status"] in _BAD:
            out += ["", f"### {s['name']}: {s['status']}", ""]
            out += [f"- `{f}`" for f in s.get("failures", [])[:30]]
            if s.get("tail") and s["status"] in _BAD:
                out += ["", "End of its output:", "", "```", s["tail"][-2500:].rstrip(), "```"]
    skipped = [(s["name"], k) for s in steps for k in s.get("skips", [])]
    if skipped:
        out += ["", "## Skip reasons", "", "| step | tests | reason |", "| --- | ---: | --- |"]
        out += [f"| {name} | {k['count']} | {k['reason'][:300].replace('|', '/')} |"
                for name, k in skipped]
    if report.get("benchmark"):
        out += ["", "## Kernel benchmark", "", *_bench_table(report["benchmark"]),
                *_variant_table(report["benchmark"].get("results", []))]
    return "\n".join(out) + "\n"
