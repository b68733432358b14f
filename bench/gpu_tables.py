"""A device call's outputs as Markdown tables (bench/gpu_issue64.sh writes one per stage as the stage ends):

    python bench/gpu_tables.py junit TESTS_XML OUT_MD          # pytest's junit XML: counts per file, each failure
    python bench/gpu_tables.py benchmark BENCH_JSON OUT_MD     # pytest-benchmark's JSON: medians beside the floor
    python bench/gpu_tables.py episodes EPISODES_JSON OUT_MD   # bench/episode_decode_time.py's --out

A missing or unreadable input writes a one-line table saying so (a stage cut short still leaves a file).
"""
from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ET
from collections import Counter


def _file(classname: str | None) -> str:
    """The test file of a junit classname (``tests.test_x`` or ``tests.test_x.TestCase``)."""
    parts = (classname or "?").split(".")
    while len(parts) > 1 and parts[-1][:1].isupper():
        parts.pop()
    return "/".join(parts) + ".py"


def junit(path: str) -> str:
    """Passed, failed, errors and skipped per test file, then each failure's or error's first line."""
    root = ET.parse(path).getroot()
    counts: dict[str, Counter] = {}
    problems = []
    for case in root.iter("testcase"):
        where = _file(case.get("classname"))
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        counts.setdefault(where, Counter())[outcome] += 1
        if outcome in ("failure", "error"):
            message = (next(c for c in case if c.tag == outcome).get("message") or "").strip().splitlines()
            problems.append(f"| {case.get('name')} | {outcome} | {message[0][:200] if message else ''} |")
    lines = ["| file | passed | failed | errors | skipped | seconds |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    seconds: Counter = Counter()
    for case in root.iter("testcase"):
        seconds[_file(case.get("classname"))] += float(case.get("time") or 0)
    for where, c in sorted(counts.items()):
        lines.append(f"| {where} | {c['passed']} | {c['failure']} | {c['error']} | {c['skipped']} "
                     f"| {seconds[where]:.1f} |")
    if problems:
        lines += ["", "| test | outcome | message |", "| --- | --- | --- |", *problems]
    return "\n".join(lines)


def benchmark(path: str) -> str:
    """Each case's median (CUDA events where timed so), its floor and the floor's share, peak extra memory."""
    with open(path) as f:
        records = json.load(f)["benchmarks"]
    lines = ["| group | impl | median ms | floor ms | floor / median | peak extra MiB | rounds |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(records, key=lambda r: (r.get("group") or "", r["name"])):
        info = r.get("extra_info", {})
        median = info.get("median_s", r["stats"]["median"])
        floor = info.get("floor_s")
        peak = info.get("peak_extra_bytes")
        lines.append(f"| {r.get('group') or ''} | {r['name']} | {median * 1e3:.3f} | "
                     f"{'–' if floor is None else f'{floor * 1e3:.3f}'} | "
                     f"{'–' if floor is None else f'{floor / median:.0%}'} | "
                     f"{'–' if peak is None else f'{peak / 2**20:,.1f}'} | {r['stats']['rounds']} |")
    return "\n".join(lines)


def episodes(path: str) -> str:
    """Seconds per batch, tokens prefilled, turns and buckets for each way of sampling the episodes."""
    with open(path) as f:
        result = json.load(f)
    lines = [f"{result['model']} on {result['device']}: {result['batches']} batches × {result['rows']} rows, "
             f"{result['rounds']} rounds, budget {result['budget']}, prompts of up to {result['prompt_tokens']} "
             f"tokens; the same episodes each way: {result['same_episodes']}", "",
             "| way | s per batch (median) | tokens prefilled | assistant turns | cache buckets |",
             "| --- | ---: | ---: | ---: | --- |"]
    for name, way in result["ways"].items():
        lines.append(f"| {name} | {statistics.median(way['seconds']):.3f} | {way['prefilled_tokens']:,} | "
                     f"{way['turns']} | {way.get('buckets', '–')} |")
    return "\n".join(lines)


KINDS = {"junit": junit, "benchmark": benchmark, "episodes": episodes}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] not in KINDS:
        raise SystemExit(f"usage: gpu_tables.py {{{','.join(KINDS)}}} INPUT OUT_MD")
    kind, source, out = argv
    try:
        text = KINDS[kind](source)
    except (OSError, ValueError, KeyError, ET.ParseError) as e:
        text = f"| {kind} |\n| --- |\n| no table: {source} could not be read ({type(e).__name__}: {e}) |"
    with open(out, "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
