"""Rule-based reward functions, usable as ``--reward_fn fastppo.rewards:NAME``.

The trainer calls a reward function once per rollout batch with keyword
arguments and expects one finite float per completion::

    fn(prompts=list[str], completions=list[str]) -> list[float] | torch.Tensor

``prompts[i]`` is the decoded query and ``completions[i]`` the decoded response
(special tokens skipped, cut after the stop token). Functions written for TRL's
GRPOTrainer (``def reward(prompts, completions, **kwargs)``) fit this signature.
"""
from __future__ import annotations

# A toy sentiment lexicon: the embedded default's task is TRL's classic
# "make GPT-2 write positive movie reviews", with a word count in place of a
# sentiment classifier so it runs offline and its optimum is obvious.
POSITIVE_WORDS = (
    "good", "great", "excellent", "wonderful", "amazing", "brilliant", "beautiful", "lovely",
    "superb", "fantastic", "delightful", "charming", "perfect", "moving", "fun", "best",
)
NEGATIVE_WORDS = (
    "bad", "awful", "terrible", "boring", "dull", "poor", "weak", "ugly",
    "horrible", "worst", "painful", "annoying", "stupid", "messy", "flat", "slow",
)
_POSITIVE = frozenset(POSITIVE_WORDS)
_NEGATIVE = frozenset(NEGATIVE_WORDS)


def positive_words(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """#positive − #negative words of each completion (``POSITIVE_WORDS`` / ``NEGATIVE_WORDS``).

    The optimum is a completion made only of positive words: its score is its length in words
    (``response_length`` for the embedded default). A count, not a fraction, so that each word
    is worth more than TRL's default KL penalty (β = 0.05) costs and the optimum stays clear.
    """
    scores = []
    for text in completions:
        words = text.lower().split()
        scores.append(float(sum(w in _POSITIVE for w in words) - sum(w in _NEGATIVE for w in words)))
    return scores


def completion_length(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """Number of words of each completion (a trivially learnable reward for tests)."""
    return [float(len(text.split())) for text in completions]
