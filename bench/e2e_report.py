"""The end-to-end comparison's text report (``trl_baseline.py``, ``bench_train.py``): per trainer the
episodes/s of every run, peak memory, the reward trend and the per-phase time split; the speedups over TRL."""
from __future__ import annotations


def _trend(scores: list[float]) -> str:
    k = max(1, len(scores) // 3)
    first, last = sum(scores[:k]) / k, sum(scores[-k:]) / k
    return f"{first:+.3f} -> {last:+.3f} (mean of first/last {k} iterations)"


def format_report(results: dict[str, list[dict]]) -> str:
    import statistics

    lines = []
    for impl, runs in results.items():
        eps = [r["episodes_per_s"] for r in runs]
        mem = [r["peak_rss_delta_bytes"] for r in runs if r["peak_rss_delta_bytes"] is not None]
        line = f"{impl:<12} episodes/s median {statistics.median(eps):7.2f}  runs {', '.join(f'{e:.2f}' for e in eps)}"
        if mem:
            line += f"  peak RSS delta {statistics.median(mem) / 2**20:.0f} MiB"
        if "peak_cuda_bytes" in runs[0]:
            line += f"  peak CUDA {runs[0]['peak_cuda_bytes'] / 2**20:.0f} MiB"
        lines.append(line)
        for r in runs:
            lines.append(f"         scores {_trend(r['scores'])}   per-iteration: "
                         + " ".join(f"{s:+.2f}" for s in r["scores"]))
            if "time_split_s" in r:
                split = {k: statistics.median(v[r['config']['warmup_iterations']:]) for k, v in r["time_split_s"].items()}
                lines.append("         median s/iteration: " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
    if "trl" in results:
        t = statistics.median(r["episodes_per_s"] for r in results["trl"])
        for impl in results:
            if impl != "trl":
                f = statistics.median(r["episodes_per_s"] for r in results[impl])
                lines.append(f"speedup {impl} / TRL: {f / t:.2f}x")
    return "\n".join(lines)
