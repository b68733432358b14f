"""The Markdown report of ``bench/grpo_baseline.py``'s runs (``format_report``): per case, each side's medians over
its rounds beside TRL's (process and loop time, memory, the first iteration apart), the reward per iteration, and
the settings each side ran with."""
from __future__ import annotations

import json
import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_baseline import GRPOCase

def _med(runs, key, f=lambda x: x):
    vals = [f(r[key]) for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _per_iteration(r) -> float:
    its = r["iteration_s"][1:] or r["iteration_s"]  # the first iteration (warm-up) left out when there are more
    return statistics.median(its)


def _ratio(side: str, num, den, suffix: str) -> str:
    if side == "trl":
        return "1"
    return "–" if not num or not den else f"{num / den:.2f}{suffix}"


def _mib(b) -> str:
    return "–" if b is None else f"{b / 2**20:,.0f}"


def format_report(results: dict[str, dict[str, list[dict]]], case: GRPOCase) -> str:
    lines = [f"Case: {case.describe()}.", ""]
    for key, by_side in results.items():
        sides = [s for s in by_side if by_side[s]]
        if not sides:
            continue
        n = len(by_side[sides[0]])
        lines += [f"### {key} ({n} round{'s' if n > 1 else ''}, medians)", "",
                  "| side | process wall s | vs TRL | start + imports s | build s | train() s | loop s | vs TRL "
                  "| launch to 1st iteration s | 1st iteration s "
                  "| s/iteration (after the 1st) | fastppo curve plot s | process peak RSS MiB | vs TRL "
                  "| peak RSS above imports MiB | peak CUDA MiB | vs TRL | reward first -> last "
                  "| mean completion tokens |", "|" + " --- |" * 19]
        trl = by_side.get("trl") or []
        trl_wall = _med(trl, "process_wall_s") if trl else None
        trl_rss = _med(trl, "process_maxrss_bytes") if trl else None
        trl_loop = _med(trl, "loop_s") if trl else None
        trl_cuda = _med(trl, "cuda_peak_bytes") if trl else None
        for side in sides:
            runs = by_side[side]
            wall, loop, rss = (_med(runs, k) for k in ("process_wall_s", "loop_s", "process_maxrss_bytes"))
            rewards = [statistics.mean(col) for col in zip(*[r["reward_mean"] for r in runs])]
            lengths = [x for r in runs for x in r["completion_length_mean"] if x is not None]
            save = statistics.median(sum(r["extra_s"].values()) for r in runs)
            cuda = _med(runs, "cuda_peak_bytes")
            cells = [
                side, f"{wall:.1f}", _ratio(side, trl_wall, wall, "x"), f"{_med(runs, 'startup_to_imports_s'):.1f}",
                f"{_med(runs, 'build_s'):.1f}", f"{_med(runs, 'train_call_s'):.1f}", f"{loop:.1f}",
                _ratio(side, trl_loop, loop, "x"),
                "–" if _med(runs, "launch_to_first_iteration_s") is None else
                f"{_med(runs, 'launch_to_first_iteration_s'):.1f}",
                f"{statistics.median(r['iteration_s'][0] for r in runs):.2f}",
                f"{statistics.median(_per_iteration(r) for r in runs):.2f}",
                "–" if side == "trl" else f"{save:.2f}", _mib(rss), _ratio(side, rss, trl_rss, ""),
                _mib(_med(runs, "peak_rss_delta_bytes")), _mib(cuda), "–" if cuda is None else _ratio(side, cuda, trl_cuda, ""),
                f"{rewards[0]:+.2f} -> {rewards[-1]:+.2f}",
                f"{statistics.mean(lengths):.1f}" if lengths else "–",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "vs TRL: TRL's time / this side's (above 1: faster than TRL), for the whole process and for "
                  "the training loop (on_train_begin to the last on_step_end); memory: this side's peak / TRL's. "
                  "The first iteration is left out of s/iteration.", "",
                  "Mean reward per iteration (mean over rounds; the reward function's own returns):", ""]
        for side in sides:
            rewards = [statistics.mean(col) for col in zip(*[r["reward_mean"] for r in by_side[side]])]
            lines.append(f"    {side:<16} " + " ".join(f"{x:+.2f}" for x in rewards))
        lines.append("")
    lines += ["Settings each side ran with (read from its config and trainer after construction; a value that "
              "differs between the cases is given per case):", ""]
    per_side: dict[str, dict[str, dict]] = {}
    for key, by_side in results.items():
        for side, runs in by_side.items():
            if runs:
                per_side.setdefault(side, {})[key] = runs[0]["settings"]
    for side, by_case in per_side.items():
        names = list(dict.fromkeys(k for settings in by_case.values() for k in settings))
        cells = []
        for name in names:
            values = {key: settings.get(name) for key, settings in by_case.items()}
            if len({json.dumps(v, default=str) for v in values.values()}) == 1:
                cells.append(f"{name}: {next(iter(values.values()))}")
            else:
                cells.append(f"{name}: " + ", ".join(f"{v} ({key})" for key, v in values.items()))
        lines.append(f"* **{side}**: " + "; ".join(cells))
    lines += ["", "Differences no setting removes: fastppo's train() saves the final model and plots curves (timed "
              "apart above; TRL saves nothing with save_strategy no); each side has its own sampler, log-prob path, "
              "prompt order and random stream, so the samples differ and the reward trends compare in distribution."]
    return "\n".join(lines)
