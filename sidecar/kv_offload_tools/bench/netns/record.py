"""What a ``bench netns --record`` run's record shows: the requests around a pod cut off and
healed (``isolate``), what the pool noticed and when (with the idle cut), each reader of the
asymmetric partition, requests for a holder behind a capped link (per half of the window),
each churn round, and what the reused, resolver and domain scenarios showed; named figures for
the prose that quotes them."""

from __future__ import annotations

from typing import Any

from kv_offload_tools.bench_records.shape import Column, Figures, Table, key


def _v(value: Any, fmt: str = "{:g}") -> str:
    return "-" if value is None else fmt.format(value)


def _halves(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for run, c in report.get("capped", {}).items():
        for half in ("first_half", "second_half"):
            rows.append(
                {
                    **c[half],
                    "run": run,
                    "half": half.split("_")[0],
                    "decisions": c["decisions"],
                    "max_link_failures": c["max_link_failures"],
                    "first": half == "first_half",
                }
            )
    return rows


# The isolate scenario's request kinds, as its table names them.
_KINDS = (("victims_chunks", "for {victim}'s chunks"), ("victims_reads", "{victim}'s own reads"),
          ("others", "everyone else's"))


def _isolate_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    iso = report.get("isolate")
    if not iso:
        return []
    rows = []
    for kind, label in _KINDS:
        for window in ("before", "during", "after", "added"):
            if window in iso[kind]:
                rows.append({**iso[kind][window], "kind": label.format(victim=iso["victim"]), "window": window})
    return rows


def _ratio(row: dict[str, Any]) -> str:
    return "" if row["window"] == "added" else _v(row["hit_ratio"], "{:.2f}")


def _signed(value: Any) -> str:
    return "-" if value is None else f"{value:+g}"


def _ms_cell(name: str) -> Any:
    return lambda r: (_signed if r["window"] == "added" else _v)(r[name])


def _noticed(report: dict[str, Any]) -> list[tuple[str, str]]:
    iso = report.get("isolate")
    if not iso:
        return []
    t, half, idle = iso["timeline_s"], iso["half_open"], report["idle"]
    victim = iso["victim"]
    return [
        (f"added p99 wait of requests for {victim}'s chunks (target <= 100 ms)",
         f"{_signed(iso['victims_chunks']['added']['p99_ms'])} ms"),
        ("requests that waited half the fetch deadline or more", str(t["stalled_requests"])),
        (f"cut -> every other sidecar calls {victim} not connected", _v(t["cut_to_all_drop_it"], "{:.2f} s")),
        (f"the same cut with no traffic to {victim} ({idle['seconds']:g} s): noticed after",
         _v(idle["cut_to_all_drop_it"], "{:.2f} s")),
        ("... and a lookup of its chunks then waited", _v(idle["lookup_after_ms"], "{:g} ms")),
        ("heal -> everyone connected / first whole hit (target <= 5 s)",
         f"{_v(t['heal_to_all_connected'], '{:.2f} s')} / {_v(t['heal_to_first_whole_hit'], '{:.2f} s')}"),
        ("half-open TCP connections: end of cut / reconnected / end",
         f"{half['end_of_cut']} / {half['reconnected']} / {half['end']}"),
        ("chunk directory current again after the heal / after the idle cut",
         f"{report['reconverged']} / {report['reconverged_after_idle']}"),
    ]


def _readers(report: dict[str, Any]) -> list[dict[str, Any]]:
    asym = report.get("asymmetric")
    if not asym:
        return []
    return [{**s, "reader": pod, "seen": asym["members_seen"][pod], "unreachable": asym["unreachable_peers"][pod],
             "connected": ", ".join(asym["connected_views"][pod])} for pod, s in asym["readers"].items()]


def _shared(pair: list[int]) -> str:
    return "{} read, {} wrong".format(*pair)


def _others(report: dict[str, Any]) -> list[tuple[str, str]]:
    """One row per scenario of reused, resolver and domain that ran: what it showed."""
    rows = []
    if "reused" in report:
        r = report["reused"]
        refusals = {**r["member_refusals"], r["other"]: r["other_pool_sidecar_refusals"]}
        counts = "; ".join(f"{pod} other_pool {c['other_pool']:g}, bad_proof {c['bad_proof']:g}"
                           for pod, c in refusals.items())
        forgotten = _v(r["seconds_from_unlisted_to_forgotten"], "{:.2f} s")
        rows.append(("reused: a departed pod's address taken by another pool",
                     f"refusals {counts}; no member links to it {forgotten} after the name stopped listing it"))
    if "resolver" in report:
        r = report["resolver"]
        rows.append((f"resolver: every pod's resolver down for {r['seconds']:g} s",
                     f"all failed within {_v(r['seconds_until_all_failed'], '{:.2f} s')}; connected links "
                     f"{r['connected_before']} before, {r['connected_during']} during; a share meanwhile "
                     f"{_shared(r['shared_during'])}"))
    if "domain" in report:
        r = report["domain"]
        rows.append((f"domain: pods of another cluster domain, found by {r['name']}",
                     f"resolved as {r['resolved']}; a share {_shared(r['shared'])}"))
    return rows


def _figure(path: tuple[str, ...], fmt: str) -> Any:
    """A named figure at ``path`` in the report (None when the run left its scenario out)."""

    def figure(report: dict[str, Any]) -> str | None:
        value: Any = report
        for step in path:
            if not isinstance(value, dict) or step not in value:
                return None
            value = value[step]
        return None if value is None else fmt.format(value)

    return figure


def _decisions(r: dict[str, Any]) -> str:
    return f"{r['decisions']['fetch']:g} / {r['decisions']['recompute']:g}" if r["first"] else ""


FIGURES = Figures(
    tables=(
        Table(
            "One pod cut from all others both ways, then healed (isolate)",
            _isolate_rows,
            (
                Column("requests", key("kind")),
                Column("window", key("window")),
                Column("requests", lambda r: "" if r["window"] == "added" else str(r["requests"])),
                Column("hit ratio", _ratio),
                Column("p50 ms", _ms_cell("p50_ms")),
                Column("p99 ms", _ms_cell("p99_ms")),
            ),
        ),
        Table(
            "What the pool noticed, and when (isolate, idle)",
            _noticed,
            (Column("figure", key(0)), Column("this run", key(1))),
        ),
        Table(
            "Asymmetric partition: one pod cannot reach another's control port",
            _readers,
            (
                Column("reader", key("reader")),
                Column("hit share before", lambda r: _v(r["before"]["hit_ratio"], "{:.2f}")),
                Column("hit share during", lambda r: _v(r["during"]["hit_ratio"], "{:.2f}")),
                Column("p99 during (ms)", lambda r: _v(r["during"]["p99_ms"])),
                Column("members it sees", key("seen")),
                Column("peers_unreachable", lambda r: _v(r["unreachable"])),
                Column("connected peers", key("connected")),
            ),
        ),
        Table(
            "A holder behind a slow link (capped)",
            _halves,
            (
                Column("run", key("run")),
                Column("half", key("half")),
                Column("requests", key("requests")),
                Column("p50 ms", lambda r: _v(r["p50_ms"])),
                Column("p99 ms", lambda r: _v(r["p99_ms"])),
                Column("stalled", key("stalled")),
                Column("decisions fetch / recompute", _decisions),
                Column("largest failure count", lambda r: str(r["max_link_failures"]) if r["first"] else ""),
            ),
        ),
        Table(
            "Churn",
            lambda report: report.get("churn", {}).get("rounds", []),
            (
                Column("round", key("round")),
                Column("survivors' links to departed pods left connected", key("departed_links_left")),
                Column("links live after", lambda r: _v(r["seconds_until_links_live"], "{:.2f} s")),
                Column(
                    "departed addresses forgotten after",
                    lambda r: _v(r["seconds_until_departed_forgotten"], "{:.2f} s"),
                ),
                Column("rejoined after", lambda r: _v(r["seconds_until_rejoined"], "{:.2f} s")),
                Column("share through a restarted pod", lambda r: _shared(r["shared"])),
                Column("survivors' fds", lambda r: ", ".join(str(v) for v in r["fds"].values())),
                Column("survivors' RSS MiB", lambda r: ", ".join(str(v) for v in r["rss_mib"].values())),
            ),
        ),
        Table(
            "An address reused, the resolver down, another cluster domain",
            _others,
            (Column("scenario", key(0)), Column("this run", key(1))),
        ),
    ),
    figures={
        "added_p99_ms": _figure(("isolate", "victims_chunks", "added", "p99_ms"), "{:+g} ms"),
        "stalled_requests": _figure(("isolate", "timeline_s", "stalled_requests"), "{}"),
        "cut_to_all_drop_it": _figure(("isolate", "timeline_s", "cut_to_all_drop_it"), "{:.2f} s"),
        "idle_noticed": _figure(("idle", "cut_to_all_drop_it"), "{:.2f} s"),
        "idle_lookup_ms": _figure(("idle", "lookup_after_ms"), "{:g} ms"),
        "heal_to_all_connected": _figure(("isolate", "timeline_s", "heal_to_all_connected"), "{:.2f} s"),
    },
)
