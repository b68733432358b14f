"""What legacy TRL's callers hand the adapter (``fastppo.legacy``): ``step()``'s queries, responses, scores and
masks, checked; the dataloader over their dataset (``batch_size`` rows per process, reshuffled each pass) and its
default collation."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler
from torch.utils.data import default_collate as torch_default_collate

from fastppo.errors import SettingsError, SettingsTypeError


def check_step_inputs(queries, responses, scores, response_masks, n: int, device) -> torch.Tensor:
    """The scores of legacy ``step()``'s arguments as a [B] tensor; a clear error for anything malformed."""
    for name, value in (("queries", queries), ("responses", responses)):
        if not isinstance(value, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in value):
            raise SettingsTypeError(f"step: {name} must be a list of 1-D token tensors")
        if len(value) != n:
            raise SettingsError(f"step: batch_size is {n} but {name} has {len(value)} samples")
        if any(t.dim() != 1 for t in value):
            raise SettingsError(f"step: every tensor in {name} must be 1-D (one sample's tokens)")
    if any(len(t) == 0 for t in queries):
        raise SettingsError("step: every query needs at least one token")
    if isinstance(scores, torch.Tensor):
        if scores.dim() > 1:
            raise SettingsError("step: scores must be one value per sample, got a tensor of shape "
                                f"{list(scores.shape)}")
        scores = scores.reshape(-1)
    else:
        scores = [torch.as_tensor(s, dtype=torch.float32) for s in scores]
        for s in scores:  # legacy TRL: each a 0-d tensor (or one value in a 1-d one), never a matrix
            if s.dim() > 1 or s.numel() != 1:
                raise SettingsError(f"step: each score must be a scalar tensor (or a 1-element 1-d one), got shape "
                                 f"{list(s.shape)}")
        scores = torch.stack([s.reshape(()) for s in scores])
    if scores.numel() != n:
        raise SettingsError(f"step: batch_size is {n} but scores has {scores.numel()} values")
    if not bool(torch.isfinite(scores).all()):
        raise SettingsError("step: scores must be finite")
    if response_masks is not None:
        if len(response_masks) != n or any(len(m) != len(r) for m, r in zip(response_masks, responses)):
            raise SettingsError("step: response_masks needs one mask per response, as long as that response")
    return scores.float().to(device)


def _collate_lists(rows: list[dict]) -> dict:
    return {key: [row[key] for row in rows] for key in rows[0]}


def default_collate(rows: list):
    """Legacy TRL's loader without a collator is torch's ``default_collate`` (tuples of tensors stacked, and so
    on); where that fails on dict rows of variable-length prompts, a dict of lists (what TRL's docs' collator
    returns) instead of an error."""
    try:
        return torch_default_collate(rows)
    except (RuntimeError, TypeError):
        if isinstance(rows[0], dict):
            return _collate_lists(rows)
        raise


def legacy_dataloader(dataset, config, state, collator: Callable | None):
    """DataLoader over ``dataset``: ``batch_size`` rows per process, shuffled (seeded), last batch dropped.

    Without a collator, torch's default one (as legacy TRL), falling back to a dict of lists for rows of
    variable-length prompts (``default_collate``)."""
    class EpochSampler(DistributedSampler):
        """Reshuffles on every pass, as accelerate's prepared loader (legacy TRL's) does by calling
        set_epoch; a plain DistributedSampler repeats its first order forever."""

        def __iter__(self):
            order = super().__iter__()  # drawn now, from seed + epoch
            self.set_epoch(self.epoch + 1)
            return order

    if state.world_size > 1:
        sampler = EpochSampler(dataset, num_replicas=state.world_size, rank=state.rank, shuffle=True,
                               seed=config.seed, drop_last=True)
    else:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(config.seed))
    return DataLoader(dataset, batch_size=config.batch_size, sampler=sampler, drop_last=True,
                      collate_fn=collator or default_collate)
