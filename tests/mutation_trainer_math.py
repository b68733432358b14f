"""Mutation check of the trainer's math: how many plausible one-line bugs the fast unit tests catch.

    python tests/mutation_trainer_math.py                 # every mutant against tests/test_trainer_math.py
    python tests/mutation_trainer_math.py --list          # the mutants, no run
    python tests/mutation_trainer_math.py --only M03 R01  # some of them
    python tests/mutation_trainer_math.py --tests tests/test_trainer_math.py tests/test_train.py

Not a pytest file (no ``test_`` prefix): it runs pytest itself, once unmutated (which must pass) and then
once per mutant. Each mutant replaces one line of ``fastppo/train.py``, ``fastppo/advantages.py``,
``fastppo/rewards.py`` or a kernel the trainer's math calls, in a private copy of the working tree's ``fastppo/``
and ``tests/`` (a temporary directory, first on the path; the checkout is never touched, so others may work in
it meanwhile). A mutant is caught when the run fails. The exit status is 0 only when every mutant is caught.

A mutant whose line is no longer in its file (the code moved on) is an error, not a pass: update its text here.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the critic-free estimators' unit tests too (their end-to-end runs are marked slow and left out)
DEFAULT_TESTS = ["tests/test_trainer_math.py", "tests/test_critic_free.py", "-m", "not slow"]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    before: str  # must occur exactly once in the file
    after: str
    bug: str


MUTANTS = [
    # ---------------------------------------------------------------- fastppo/train.py
    Mutant("M01", "fastppo/advantages.py", "rewards = whiten_trained(rewards, response_mask, shift_mean=False)",
           "rewards = whiten_trained(rewards, response_mask, shift_mean=True)",
           "whiten_rewards removes the rewards' mean (TRL keeps it: shift_mean=False)"),
    Mutant("M02", "fastppo/train.py",
           "v_clipped = old_values + (new_values - old_values).clamp("
           "-settings.cliprange_value, settings.cliprange_value)",
           "v_clipped = returns + (new_values - returns).clamp(-settings.cliprange_value, settings.cliprange_value)",
           "the value clip anchored on the returns, not the old values (value clipping silently off)"),
    Mutant("M03", "fastppo/rollout.py", "return t - 1 - self.response_mask.flip(1).int().argmax(1)",
           "return self.response_mask.int().argmax(1)",
           "score_index: the first trained token instead of the last"),
    Mutant("M04", "fastppo/train.py", "non_score_reward = -kl_coef * kl * response_mask",
           "non_score_reward = -kl_coef * kl", "the KL penalty not masked to the trained tokens"),
    Mutant("M05", "fastppo/train.py", "rewards[rows, score_index] += scores", "rewards[rows, score_index] = scores",
           "the score replaces its token's KL penalty instead of adding to it"),
    Mutant("M06", "fastppo/advantages.py",
           "advantages, returns = gae(rewards, values, response_mask, gamma, lam, skip_masked=skip_masked)",
           "advantages, returns = gae(rewards, values, response_mask, lam, gamma, skip_masked=skip_masked)",
           "GAE's gamma and lam swapped"),
    Mutant("M07", "fastppo/advantages.py",
           "advantages, returns = gae(rewards, values, response_mask, gamma, lam, skip_masked=skip_masked)",
           "advantages, returns = gae(rewards, values, response_mask, gamma, lam)",
           "skip_masked not passed on to GAE"),
    Mutant("M08", "fastppo/advantages.py", "return whiten_trained(advantages, response_mask), returns",
           "return whiten_trained(advantages, response_mask, shift_mean=False), returns",
           "the advantages whitened keeping their mean"),
    Mutant("M09", "fastppo/train.py", "loss=0.5 * aggregate(torch.max(value.error, value.clipped_error), mask,",
           "loss=0.5 * aggregate(torch.min(value.error, value.clipped_error), mask,",
           "the value loss takes the smaller of the two errors"),
    Mutant("M10", "fastppo/train.py", "loss=0.5 * aggregate(torch.max(value.error, value.clipped_error), mask,",
           "loss=aggregate(torch.max(value.error, value.clipped_error), mask,", "the value loss without its ½"),
    Mutant("M11", "fastppo/train.py", "policy_loss = pg_loss - entropy_coef * mean_entropy",
           "policy_loss = pg_loss + entropy_coef * mean_entropy", "the entropy bonus with the wrong sign"),
    Mutant("M12", "fastppo/train.py", '("vf_clipfrac", masked_mean((v.clipped_error > v.error).float(), mask))',
           '("vf_clipfrac", masked_mean((v.error > v.clipped_error).float(), mask))',
           "val/clipfrac counts the tokens the clip did not win"),
    Mutant("M13", "fastppo/train.py", '("policykl", masked_mean(-t.log_ratio, mask))',
           '("policykl", masked_mean(t.log_ratio, mask))', "policykl (early stopping's KL) with the wrong sign"),
    Mutant("M14", "fastppo/controllers.py", "self.value *= 1.0 + error * n_steps / self.horizon",
           "self.value *= 1.0 + error / self.horizon", "the adaptive KL controller ignores n_steps"),
    Mutant("M15", "fastppo/advantages.py", "return (x if not shift_mean else torch.zeros_like(x)) * mask",
           "return (x if shift_mean else torch.zeros_like(x)) * mask",
           "whitening a single trained token: centred and kept swapped"),
    # ---------------------------------------------------------------- fastppo/rewards.py
    Mutant("R01", "fastppo/rewards.py",
           "m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total",
           "m2 = self.var * self.count + batch_var * n",
           "RunningMoments without the between-batch term (std 0.894 for 5.550 after [0,1,2], [10,11,12])"),
    Mutant("R02", "fastppo/rewards.py", "self.std = math.sqrt(self.var * total / (total - 1)) if total > 1 else math.inf",
           "self.std = math.sqrt(self.var) if total > 1 else math.inf", "RunningMoments' std without Bessel's correction"),
    Mutant("R03", "fastppo/rewards.py",
           "scores = (scores - moments.mean) / scale if use_score_norm else scores / scale",
           "scores = (scores - moments.mean) / scale", "use_score_scaling centres the scores without use_score_norm"),
    Mutant("R04", "fastppo/rewards.py", "scores = scores.clamp(-score_clip, score_clip)",
           "scores = scores.clamp(max=score_clip)", "score_clip clips the high side only"),
    Mutant("R05", "fastppo/rewards.py", "self.std = math.sqrt(self.var * total / (total - 1)) if total > 1 else math.inf",
           "self.std = math.sqrt(self.var * total / max(total - 1, 1))",
           "the std of a single score ~1e-12 (Bessel's divisor floored at 1): that score multiplied by ~1e7"),
    # ------------------------------------------------------------ the critic-free estimators (fastppo/advantages.py)
    Mutant("C01", "fastppo/advantages.py", "baseline = (r.nansum(1, keepdim=True) - r) / (judged - 1)",
           "baseline = r.nansum(1, keepdim=True) / judged",
           "rloo's baseline includes the sample itself (the group mean)"),
    Mutant("C02", "fastppo/advantages.py",
           "std = (nan_std(r, 1, keepdim=True) if k > 1 else torch.zeros_like(r)).expand(-1, k).reshape(-1)",
           "std = (r.std(1, keepdim=True, unbiased=False) if k > 1 else torch.zeros_like(r)).expand(-1, k).reshape(-1)",
           "grpo's group std without Bessel's correction (TRL's is unbiased)"),
    Mutant("C03", "fastppo/advantages.py", "if scale_rewards == \"none\":", "if scale_rewards == \"batch\":",
           "scale_rewards batch and none swapped"),
    Mutant("C04", "fastppo/advantages.py",
           "_, returns = gae(rewards, torch.zeros_like(rewards), response_mask, gamma, 1.0)",
           "_, returns = gae(rewards, torch.zeros_like(rewards), response_mask, 1.0, 1.0)",
           "REINFORCE++'s return ignores gamma"),
    Mutant("C05", "fastppo/advantages.py", "advantage = rloo_advantages(rewards.sum(1), config.num_generations)",
           "advantage = rloo_advantages(rewards.max(1).values, config.num_generations)",
           "rloo drops the KL from the sequence reward"),
    Mutant("C06", "fastppo/train.py",
           "kl_tokens = kl_tokens * ratio if settings.bias_correction_kl else kl_tokens",
           "kl_tokens = kl_tokens", "beta's KL without TRL's ratio weighting (bias correction)"),
    Mutant("C07", "fastppo/advantages.py", "return advantage.nan_to_num(0.0)[:, None] * response_mask, None",
           "return advantage.nan_to_num(0.0)[:, None].expand(response_mask.shape).clone(), None",
           "a sequence advantage also on untrained (padding) positions"),
    # ---------------------------------------------------------------- the kernels' PyTorch statements the trainer runs
    Mutant("K01", "fastppo/kernels/ppo_loss.py", "return torch.max(unclipped, clipped), ratio, clipped > unclipped",
           "return torch.min(unclipped, clipped), ratio, clipped > unclipped",
           "the clipped surrogate takes the optimistic (min) term"),
    Mutant("K02", "fastppo/kernels/stats.py", "mean, var = _var(x, m, unbiased=True)",
           "mean, var = _var(x, m, unbiased=False)", "masked_whiten with the biased variance"),
]


def copy_tree(dest: Path) -> None:
    """The working tree's package and tests, without caches (PYTHONDONTWRITEBYTECODE keeps the copy free of
    bytecode: a stale .pyc of the same size and second would hide a mutant)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")
    shutil.copytree(ROOT / "fastppo", dest / "fastppo", ignore=ignore)
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def run_tests(dest: Path, tests: list[str], timeout: float) -> tuple[str, str, float]:
    """('passed' | 'failed' | 'timeout', first failing test or '', seconds)."""
    env = dict(os.environ, PYTHONPATH=str(dest), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", "", time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    if proc.returncode == 0:
        return "passed", "", seconds
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
    return "failed", failed[0] if failed else (proc.stdout + proc.stderr)[-400:], seconds


def check_imports_the_copy(dest: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(dest), PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run([sys.executable, "-c", "import fastppo, fastppo.train; print(fastppo.train.__file__)"],
                         cwd=dest, env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(dest.resolve()):
        sys.exit(f"the copy is not what Python imports ({out}); cannot measure")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--tests", nargs="+", default=DEFAULT_TESTS, help="test files (relative to the root)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run (a timeout counts as caught)")
    args = parser.parse_args()
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name}  {m.path}: {m.bug}\n      - {m.before}\n      + {m.after}")
        return 0
    with tempfile.TemporaryDirectory(prefix="fastppo-mutation-") as tmp:
        dest = Path(tmp)
        copy_tree(dest)
        check_imports_the_copy(dest)
        for m in mutants:  # every mutant's line is there once, before anything runs
            n = (dest / m.path).read_text().count(m.before)
            if n != 1:
                sys.exit(f"{m.name}: its line occurs {n} times in {m.path} (expected once); update the mutant:\n"
                         f"  {m.before}")
        status, first, seconds = run_tests(dest, args.tests, args.timeout)
        print(f"unmutated: {status} ({seconds:.1f} s)", flush=True)
        if status != "passed":
            print(first)
            return 2
        caught = 0
        for m in mutants:
            path = dest / m.path
            original = path.read_text()
            path.write_text(original.replace(m.before, m.after, 1))
            try:
                status, first, seconds = run_tests(dest, args.tests, args.timeout)
            finally:
                path.write_text(original)
            killed = status != "passed"
            caught += killed
            verdict = {"failed": "caught", "timeout": "caught (timeout)", "passed": "SURVIVED"}[status]
            print(f"{m.name} {verdict:<16} {seconds:5.1f} s  {m.bug}" + (f"\n      by {first}" if first else ""),
                  flush=True)
        print(f"\ncaught {caught}/{len(mutants)} mutants ({100 * caught / len(mutants):.0f}%) with {' '.join(args.tests)}")
        return 0 if caught == len(mutants) else 1


if __name__ == "__main__":
    sys.exit(main())
