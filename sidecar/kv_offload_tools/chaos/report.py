"""Tables and plots of the chaos runs: one row per fault class (and one per plane of the late
writer), one per fuzz target."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kv_offload_tools.chaos.faults.bench import BenchSettings, FaultResult
from kv_offload_tools.chaos.faults.late_writer_row import ROW_SECONDS, LateWriterResult

if TYPE_CHECKING:  # the fuzz runner imports hypothesis, which a fault run does not need
    from kv_offload_tools.chaos.fuzz.runner import FuzzResult


def faults_table(results: Sequence[FaultResult]) -> str:
    """The figures as a markdown table."""
    head = ("| fault | injected | in flight | survived | loads | loads turned into misses | "
            "corrupt chunks delivered | chunks lost | chunks refused by checksum | "
            "worst give-up (s) | store peak / budget |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results:
        store = (f"{r.store_peak_bytes / 2**20:.2f} / {r.store_budget_bytes / 2**20:.2f} MiB"
                 if r.store_budget_bytes else "-")
        lines.append(f"| {r.fault} | {r.injected} | {r.in_flight} | {r.survived} | {r.loads} | "
                     f"{r.loads_missed} | {r.corrupt_delivered} | {r.lost} | {r.integrity_rejected} | "
                     f"{r.worst_give_up_seconds:.3f} | {store} |")
    return "\n".join(lines)


def late_writer_table(results: Sequence[LateWriterResult]) -> str:
    """The late-writer figures as a markdown table, one row per plane."""
    lines = ["| late writer | runs of each case | holder stopped mid-chunk | loop blocked with rows "
             "filling | bytes after a deadline | writes refused (stopped / blocked) | "
             "slots held mid-write (ucx, nixl) | chunks stored after a cut, verified | "
             "unexpected endings | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.plane} | {r.runs} | {r.holder_stopped_in_flight} | {r.loop_blocked_in_flight} | "
                     f"{r.bytes_after_deadline} | {r.writes_refused} ({r.refused_holder_stopped} / "
                     f"{r.refused_loop_blocked}) | {r.slots_held} | {r.chunks_stored}, {r.chunks_verified} | "
                     f"{r.unexpected_endings} | {r.seconds:.0f} |")
    return "\n".join(lines)


def plot_faults(results: Sequence[FaultResult], settings: BenchSettings, path: str,
                late: Sequence[LateWriterResult] = ()) -> None:
    """Three panels: faults injected/survived, worst give-up vs the deadline, store bytes vs budget;
    a fourth with ``late``: writes refused and bytes written after a deadline per plane (only
    that one without ``results``: a --late-writer-only run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not results:
        fig, ax = plt.subplots(figsize=(7, 5.2))
        _plot_late_writer(ax, late)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return

    fig, axes = plt.subplots(1, 4 if late else 3, figsize=(23 if late else 17, 5.2))
    names = [r.fault for r in results]
    xs = range(len(results))
    ax = axes[0]
    ax.bar([x - 0.2 for x in xs], [r.injected for r in results], 0.4, label="injected")
    ax.bar([x + 0.2 for x in xs], [r.survived for r in results], 0.4, label="survived")
    for x, r in zip(xs, results):
        if r.corrupt_delivered or r.lost:
            ax.annotate(f"corrupt {r.corrupt_delivered}\nlost {r.lost}", (x, r.injected),
                        ha="center", va="bottom", color="red", fontsize=8)
    ax.set_xticks(list(xs), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("faults")
    ax.set_title(f"Faults injected and survived on {settings.transport} (red: corrupt or lost chunks)")
    ax.legend()
    ax = axes[1]
    ax.bar(list(xs), [r.worst_give_up_seconds for r in results], color="tab:orange")
    ax.axhline(settings.fetch_deadline_seconds, color="black", linestyle="--",
               label=f"fetch deadline {settings.fetch_deadline_seconds:g} s")
    ax.set_xticks(list(xs), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title("Worst time for a load or fetch to give up")
    ax.legend()
    ax = axes[2]
    flood = next((r for r in results if r.series.get("store_used_bytes")), None)
    if flood is not None:
        ts, used = zip(*flood.series["store_used_bytes"])
        ax.plot(ts, [u / 2**20 for u in used], label="store bytes in use")
        ax.axhline(flood.store_budget_bytes / 2**20, color="red", linestyle="--", label="budget")
        ax.set_xlabel("seconds into the 10x write flood")
        ax.set_ylabel("MiB")
        ax.legend(loc="lower right")
    ax.set_title("Store bytes in use vs budget (10x writes)")
    if late:
        _plot_late_writer(axes[3], late)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_late_writer(ax: Any, late: Sequence[LateWriterResult]) -> None:
    xs = range(len(late))
    refused = [r.writes_refused for r in late]
    after = [r.bytes_after_deadline for r in late]
    ax.bar([x - 0.2 for x in xs], refused, 0.4, label="writes refused by the gates")
    ax.bar([x + 0.2 for x in xs], after, 0.4, color="red", label="bytes written after a deadline")
    for x, r in zip(xs, late):
        ax.annotate(f"{r.bytes_after_deadline} B late", (x + 0.2, r.bytes_after_deadline), ha="center",
                    va="bottom", color="red" if r.bytes_after_deadline else "black", fontsize=8)
    ax.set_xticks(list(xs), [f"{r.plane}\n{r.runs} runs each" for r in late])
    ax.set_ylabel("writes / bytes")
    ax.set_title(f"Late writer (rows due in {ROW_SECONDS:g} s):\nholder SIGSTOP/SIGCONT, fetcher loop blocked")
    ax.legend()


def fuzz_table(result: FuzzResult) -> str:
    """The fuzz figures as a markdown table."""
    lines = ["| message | cases | correct answers | clear errors | incomplete input | failures |",
             "|---|---|---|---|---|---|"]
    for t in result.targets:
        lines.append(f"| {t.target} | {t.cases} | {t.answers} | {t.errors} | {t.incomplete} | {t.failures} |")
    lines.append(f"| **total** | {result.cases} | {sum(t.answers for t in result.targets)} | "
                 f"{sum(t.errors for t in result.targets)} | {sum(t.incomplete for t in result.targets)} | "
                 f"{result.failures} |")
    lines.append("")
    lines.append(f"Sidecar crashes: {result.crashes}; hangs: {result.hangs}; RSS "
                 f"{result.rss_start_bytes / 2**20:.1f} MiB after warm-up, "
                 f"{result.rss_end_bytes / 2**20:.1f} MiB at the end (peak "
                 f"{result.rss_peak_bytes / 2**20:.1f} MiB, bound +{result.rss_bound_bytes / 2**20:.0f} MiB).")
    return "\n".join(lines)


def plot_fuzz(result: FuzzResult, path: str) -> None:
    """Cases per message by outcome, and the sidecar's RSS across the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    names = [t.target for t in result.targets]
    bottom = [0] * len(names)
    for label, attr in (("correct answer", "answers"), ("clear error", "errors"),
                        ("incomplete input", "incomplete"), ("failure", "failures")):
        vals = [getattr(t, attr) for t in result.targets]
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("cases")
    ax.set_title(f"{result.cases} fuzz cases by outcome")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, fontsize=8)
    ax = axes[1]
    if result.rss_series:
        xs, rss = zip(*result.rss_series)
        ax.plot(xs, [r / 2**20 for r in rss], label="sidecar RSS")
        ax.axhline((result.rss_start_bytes + result.rss_bound_bytes) / 2**20, color="red",
                   linestyle="--", label="bound")
        ax.set_ylim(0, (result.rss_start_bytes + result.rss_bound_bytes) / 2**20 * 1.1)
    ax.set_xlabel("cases")
    ax.set_ylabel("MiB")
    ax.set_title("Sidecar memory across the run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
