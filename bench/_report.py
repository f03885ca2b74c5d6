"""The report: the targets judged (PASS/FAIL), the markdown that stdout shows, and the
machine the figures were measured on (without which they mean little)."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import trio

from bench._output import markdown_table, read_file
from bench._settings import REPO_DIR, SERVER_SCENARIOS, Settings, Target
from bench._stats import Figures, percentile, summarize

if TYPE_CHECKING:
    from bench.scenarios.diffusers import DiffusersScenario


class Section(Protocol):
    """A scenario that reports in a section of its own (it starts its own servers):
    its description and table as markdown lines."""

    def markdown(self) -> list[str]: ...


def make_verdict(
    name: str,
    measured: float | None,
    limit: float | None,
    rule: str,
    note: str = "",
    *,
    at_least: bool = False,
) -> dict[str, Any]:
    """One target judged: N/A without a measurement or a limit; ``at_least`` for a
    figure that must reach its limit (a speed-up) rather than stay under it."""
    status = "N/A" if measured is None or limit is None else "PASS"
    if status == "PASS":
        assert measured is not None and limit is not None
        if (measured < limit) if at_least else (measured > limit):
            status = "FAIL"
    return {
        "target": name,
        "rule": rule,
        "measured": measured,
        "threshold": limit,
        "status": status,
        "note": note,
    }


def cleanup_verdict(scenario: str, checks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Nothing left on a server after each part of a scenario that started its own."""
    leftovers = [c for c in checks if c["ok"] is False]
    unknown = not checks or any(c["ok"] is None for c in checks)
    return {
        "target": f"{scenario}: cleanup, nothing left on the server after each level",
        "rule": "sessions_active = streams_open = worker_threads = 0",
        "measured": {"checks_with_leftovers": len(leftovers), "checks": len(checks)},
        "threshold": None,
        "status": "N/A" if unknown else "FAIL" if leftovers else "PASS",
        "note": "needs /stats" if unknown else "",
    }


def evaluate(
    figures: Figures,
    target: Target,
    s: Settings,
    checks: Sequence[dict[str, Any]],
    runs: Sequence[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The targets the harness exists to show. Never loosened to fit a result."""
    results: list[dict[str, Any]] = []

    def verdict(
        name: str, measured: float | None, limit: float | None, rule: str, note: str = ""
    ) -> None:
        results.append(make_verdict(name, measured, limit, rule, note))

    verdict(
        "control plane: ping RTT p99, 8 sessions streaming",
        figures.stat("concurrency.n8.ping_rtt_ms", "p99"),
        50.0,
        "p99 <= 50 ms",
    )
    step_ms = None if target.step_s is None else target.step_s * 1000
    for phase, label in (("idle", "alone"), ("load", f"{s.abort_load} others streaming")):
        verdict(
            f"abort: stop -> done p99, {label}",
            figures.stat(f"abort.{phase}.stop_done_ms", "p99"),
            None if step_ms is None else step_ms + 50,
            "p99 <= one engine step + 50 ms",
            "" if step_ms is not None else "engine step unknown: pass --engine-step",
        )
    ttfc = figures.stat("latency.ttfc_ms", "median")
    engine = figures.stat("calib.engine_first_chunk_ms", "median")
    encode = figures.stat("calib.encode_first_chunk_ms", "median")
    verdict(
        "transport overhead: median TTFC - engine's median first chunk",
        None if ttfc is None or engine is None else ttfc - engine,
        None if encode is None else encode + 20,
        "<= median encode of one (first) chunk + 20 ms",
        "" if engine is not None else "engine time unknown (engine not synthetic)",
    )
    leftovers = [c for c in checks if c["ok"] is False]
    unknown = not checks or any(c["ok"] is None for c in checks)
    returned = [r.get("threads", {}).get("returned_s") is not None for r in runs]
    status = "N/A" if unknown else "PASS" if not leftovers and all(returned) else "FAIL"
    results.append(
        {
            "target": "cleanup: nothing left after any scenario, threads back after every run",
            "rule": "sessions_active = streams_open = worker_threads = 0 after each scenario; "
            "threads_alive back at its baseline",
            "measured": {
                "scenarios_with_leftovers": len(leftovers),
                "runs_with_threads_back": f"{sum(returned)}/{len(returned)}",
            },
            "threshold": None,
            "status": status,
            "note": "needs /stats" if unknown else "",
        }
    )
    return results


def format_figure(value: Any) -> str:
    """Three significant digits or so: enough to compare, few enough to read."""
    if not isinstance(value, int | float) or not math.isfinite(value):
        return "n/a"
    magnitude = abs(value)
    digits = 3 if magnitude < 1 else 2 if magnitude < 10 else 1 if magnitude < 1000 else 0
    return f"{value:.{digits}f}"


def median_and_range(values: Sequence[float]) -> str:
    """A report cell: the median over runs, and their range where they differ; whole
    numbers (counts) as they are."""
    if not values:
        return "n/a"

    def shown(value: float) -> str:
        return f"{value:g}" if float(value).is_integer() else format_figure(value)

    text = shown(percentile(list(values), 50))
    if min(values) != max(values):
        text += f" ({shown(min(values))} - {shown(max(values))})"
    return text


def figure_rows(figures: Figures) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for fig in figures:
        stats = summarize(fig.pooled)
        medians = [summarize(r)["median"] for r in fig.runs if r]
        spread = (
            f"{format_figure(min(medians))} - {format_figure(max(medians))}"
            if len(medians) > 1
            else ""
        )
        rows.append(
            (
                fig.name,
                fig.unit,
                format_figure(stats["median"]),
                format_figure(stats["p99"]),
                spread,
                str(stats["n"]),
            )
        )
    return rows


def compare_rows(a: Figures, b: Figures) -> list[tuple[str, ...]]:
    def ratio(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None or x == 0 else y / x

    rows: list[tuple[str, ...]] = []
    for fig in a:
        other = b.get(fig.name)
        if other is None:
            continue
        sa, sb = summarize(fig.pooled), summarize(other.pooled)
        rows.append(
            (
                fig.name,
                fig.unit,
                format_figure(sa["median"]),
                format_figure(sb["median"]),
                format_figure(ratio(sa["median"], sb["median"])),
                format_figure(sa["p99"]),
                format_figure(sb["p99"]),
                format_figure(ratio(sa["p99"], sb["p99"])),
            )
        )
    return rows


def compare_json(a: Figures, b: Figures) -> dict[str, dict[str, str]]:
    """The --compare table as JSON, one entry per metric, as the table shows it."""
    keys = ("A_median", "B_median", "ratio_median", "A_p99", "B_p99", "ratio_p99")
    return {row[0]: dict(zip(keys, row[2:], strict=True)) for row in compare_rows(a, b)}


def _verdict_line(v: dict[str, Any], prefix: str = "") -> str:
    measured = v["measured"]
    shown = json.dumps(measured) if isinstance(measured, dict) else format_figure(measured)
    limit = "" if v["threshold"] is None else f" (limit {format_figure(v['threshold'])})"
    note = f"; {v['note']}" if v["note"] else ""
    return f"- **{v['status']}** {prefix}{v['target']}: {shown}{limit}; {v['rule']}{note}"


def render(
    report: dict[str, Any],
    targets: Sequence[Target],
    per_target: dict[str, Figures],
    local: Figures,
    verdicts: dict[str, list[dict[str, Any]]],
    s: Settings,
    diffusers: DiffusersScenario | None = None,
    sections: Sequence[Section] = (),
    section_verdicts: Sequence[dict[str, Any]] = (),
) -> str:
    """The markdown report: the main target's table, then each scenario that started
    servers of its own (diffusers, ``sections``), then every verdict."""
    m = report["machine"]
    git = m["git"]
    dirty = " (with uncommitted changes)" if git.get("dirty_files") else ""
    lines = [
        f"Command: `{report['command']}`",
        "",
        f"Machine: {m['cpu_model']}, {m['cpu_count']} cores, {m['ram_gib']} GiB RAM, {m['os']}, "
        f"Python {m['python']}, trio {m['versions']['trio']}, av {m['versions']['av']}, "
        f"torch {m['versions']['torch']}, commit {git.get('commit', '?')[:10]}{dirty}",
    ]
    # With only scenarios that start their own servers (diffusers, batching, effect), and
    # maybe the encoder, the main target was never measured: no table and no verdicts.
    served = any(n in s.scenarios for n in SERVER_SCENARIOS)
    main_settings = (
        f"{s.size} at {s.fps} fps, {s.repeat} run(s) per target, concurrency levels "
        f"{','.join(map(str, s.levels))} for {s.window_s:g} s each, a ping every "
        f"{s.ping_interval_s * 1000:.0f} ms per session"
    )
    lines += [
        f"Settings: {main_settings if served else f'{s.repeat} run(s)'}"
        + (" (quick mode: indicative only)" if s.quick else ""),
        "",
    ]
    header = ("metric", "unit", "median", "p99", "run medians (min - max)", "n")
    if served:
        lines += [f"Target {t.label}: `{t.shown}`" for t in targets] + [""]
        if len(targets) == 2:
            compare_header = ("metric", "unit", "A median", "B median", "B/A", "A p99", "B p99")
            lines.append(
                markdown_table(
                    (*compare_header, "B/A p99"), compare_rows(per_target["A"], per_target["B"])
                )
            )
        else:
            lines.append(markdown_table(header, figure_rows(per_target[targets[0].label])))
    if any(True for _ in local):
        lines += ["", markdown_table(header, figure_rows(local))]
    if diffusers is not None:
        p, size = diffusers.preset, diffusers.preset.model
        lines += [
            "",
            f"Diffusers: preset {p.name} on {p.device}: random Wan, {size.layers} blocks of "
            f"width {size.heads * size.head_dim} (ffn {size.ffn_dim}), VAE base {size.vae_base_dim}"
            f"; {p.width}x{p.height}, {p.segment_frames} frames per segment, {p.steps} steps, "
            f"guidance {p.guidance_scale:g}; {s.diffusers_segments} segments per session, "
            f"{s.diffusers_reps} session(s) per side per run; threads=1 (torch threads in the "
            f"direct worker: {diffusers.inproc_torch_threads})",
            "",
        ]
        if diffusers.target is not None:
            lines += [f"Server: `{diffusers.target.shown}`", ""]
        lines.append(markdown_table(header, figure_rows(diffusers.figures)))
    for section in sections:
        lines += ["", *section.markdown()]
    if served:
        for target in targets:
            unavailable = per_target[target.label].unavailable
            if unavailable:
                shown = "; ".join(f"{name} ({why})" for name, why in unavailable.items())
                lines += ["", f"Unavailable for {target.label}: {shown}"]
    lines.append("")
    if served:
        for target in targets:
            prefix = f"{target.label}: " if len(targets) > 1 else ""
            lines += [_verdict_line(v, prefix) for v in verdicts[target.label]]
    if diffusers is not None:
        lines += [_verdict_line(v) for v in report["diffusers"]["targets"]]
    lines += [_verdict_line(v) for v in section_verdicts]
    return "\n".join(lines)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


async def _git(*args: str) -> str:
    done = await trio.run_process(
        ["git", "-C", str(REPO_DIR), *args], capture_stdout=True, capture_stderr=True
    )
    return done.stdout.decode()


async def machine_description() -> dict[str, Any]:
    cpuinfo = read_file("/proc/cpuinfo")
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    memory = re.search(r"^MemTotal:\s*(\d+)\s*kB", read_file("/proc/meminfo"), re.M)
    os_release = re.search(r'^PRETTY_NAME="?([^"\n]+)"?', read_file("/etc/os-release"), re.M)
    try:
        dirty = await _git("status", "--porcelain", "--untracked-files=no")
        git: dict[str, Any] = {
            "commit": (await _git("rev-parse", "HEAD")).strip(),
            "dirty_files": [line[3:] for line in dirty.splitlines()],
        }
    except (OSError, subprocess.CalledProcessError) as exc:
        git = {"error": str(exc)}
    try:
        import av

        libav = {k: ".".join(map(str, v)) for k, v in av.library_versions.items()}
    except ImportError:  # the harness can still measure a remote server
        libav = {}
    return {
        "cpu_model": model.group(1).strip() if model else platform.processor(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_gib": round(int(memory.group(1)) / 2**20, 1) if memory else None,
        "os": os_release.group(1) if os_release else platform.system(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "switch_interval_s": sys.getswitchinterval(),
        "loadavg_at_start": read_file("/proc/loadavg").split()[:3],
        "versions": {
            name: _version(name)
            for name in (
                "trio-vstream",
                "trio",
                "trio-websocket",
                "wsproto",
                "av",
                "numpy",
                "torch",
            )
        },
        "libav": libav,
        "git": git,
    }
