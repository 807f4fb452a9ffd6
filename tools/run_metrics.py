"""run_metrics.py — read shardlm run directories for tools/plot_runs.py, tools/summarize_runs.py and the RL
benchmarks' reports (tools/rl_*_report.py).

A run directory holds config.toml (the resolved deck of the latest start),
metrics.jsonl (docs/metrics.md: step rows plus "start", "resume" and "end"
event rows) and, while a run holds it, run.lock. Nothing here depends on more
than the standard library (tomllib: Python 3.11+).
"""

import json
import math
import os
import socket
import statistics
import time

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

STALE_LOCK_S = 120
# Muon's keys: a deck resolves them from optim.lr / weight_decay even when Muon is not used.
MUON_ONLY = {"optim.adamw_lr", "optim.adamw_weight_decay", "optim.muon_momentum", "optim.ns_steps"}  # a lock from another host untouched this long is stale (src/base/run_dir.cpp)


class Run:
    """One run directory: its deck, step rows (one per step, the last written wins) and events."""

    def __init__(self, path):
        self.path = path.rstrip("/") or path
        if not os.path.isdir(self.path):
            raise SystemExit(f"{path}: no such run directory")
        self.deck = read_deck(os.path.join(self.path, "config.toml"))
        self.rows, self.events, self.bad_lines = read_metrics(self.metrics_path())
        name = self.deck.get("run.name")
        self.name = name if isinstance(name, str) and name else os.path.basename(self.path)

    def metrics_path(self):
        return os.path.join(self.path, self.deck.get("log.jsonl", "metrics.jsonl"))

    def max_steps(self):
        for e in reversed(self.events):
            if "max_steps" in e:
                return e["max_steps"]
        return self.deck.get("run.max_steps")

    def last_step(self):
        return self.rows[-1]["step"] if self.rows else 0

    def status(self):
        """running | done | stopped | checkpoint_failed | crashed | empty."""
        if lock_is_live(os.path.join(self.path, "run.lock")):
            return "running"
        for e in reversed(self.events):
            if e.get("event") == "end":
                return e.get("status", "ended")
            if e.get("event") in ("start", "resume"):
                return "crashed"  # a start with no end: killed, or a fatal error
        return "empty" if not self.rows else "crashed"

    def series(self, key):
        """(steps, values) of a step-row field; None and missing become NaN."""
        steps = [r["step"] for r in self.rows]
        return steps, [number(r.get(key)) for r in self.rows]

    def resume_steps(self):
        return [e["step"] for e in self.events if e.get("event") == "resume"]


def number(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def read_deck(path):
    """config.toml flattened to {"section.key": value}; {} when absent."""
    if not os.path.exists(path):
        return {}
    if tomllib is None:
        raise SystemExit("reading config.toml needs Python 3.11+ (tomllib)")
    with open(path, "rb") as f:
        deck = tomllib.load(f)
    return {f"{s}.{k}": v for s, table in deck.items() if isinstance(table, dict) for k, v in table.items()}


def jsonl_rows(path):
    """Every row of a JSON-lines file (rollouts.jsonl, eval.jsonl, metrics.jsonl) in file order; [] when
    the file does not exist."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_metrics(path):
    """(step rows in step order, the last row of each step winning; event rows; unreadable lines)."""
    by_step, events, bad = {}, [], 0
    if not os.path.exists(path):
        return [], [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad += 1  # a torn last line from a crash
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                bad += 1
            elif "event" in row:
                events.append(row)
            else:
                by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)], events, bad


def lock_is_live(path):
    """True when run.lock names a process that still runs (this host) or was touched lately (another host)."""
    try:
        with open(path) as f:
            holder = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
        touched = os.stat(path).st_mtime
    except OSError:
        return False
    if holder.get("host") == socket.gethostname():
        try:
            pid = int(holder.get("pid", "0"))
            os.kill(pid, 0)
        except (OSError, ValueError):
            return False
        try:  # an exited process nobody has reaped yet still has its pid
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return True
    return time.time() - touched < STALE_LOCK_S


def differing_keys(runs, ignore=("run.dir", "run.name")):
    """The deck keys whose values are not the same in every run, in deck order (the
    run's directory and name identify it: they are columns of their own)."""
    keys = []
    for run in runs:
        for k in run.deck:
            if k not in keys and k not in ignore:
                keys.append(k)
    if not any(r.deck.get("optim.name") == "muon" for r in runs):  # resolved from optim.lr / weight_decay
        keys = [k for k in keys if k not in MUON_ONLY]
    missing = object()
    return [k for k in keys if len({repr(r.deck.get(k, missing)) for r in runs}) > 1]


def label(run, keys):
    """A legend / table label: the run's name and its values of the differing keys."""
    parts = [f"{k.split('.', 1)[1]}={format_value(run.deck.get(k))}" for k in keys if k != "run.name"]
    return run.name + (f" ({', '.join(parts)})" if parts else "")


def format_value(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def smoothed(values, window):
    """Mean of the last `window` finite values (NaN when there are none)."""
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite[-window:]) if finite else math.nan


def steady_median(run, key):
    """Median of a rate over the step rows, leaving out the first row after each (re)start (warm-up)."""
    starts = sorted(e["step"] for e in run.events if e.get("event") in ("start", "resume"))
    warmup_rows = set()
    for s in starts:
        first = next((r["step"] for r in run.rows if r["step"] > s), None)
        if first is not None:
            warmup_rows.add(first)
    values = [number(r.get(key)) for r in run.rows if r["step"] not in warmup_rows]
    values = [v for v in values if math.isfinite(v)]
    if not values:  # a run of one logged row
        values = [v for v in (number(r.get(key)) for r in run.rows) if math.isfinite(v)]
    return statistics.median(values) if values else math.nan
