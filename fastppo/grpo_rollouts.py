"""Step 1 as TRL 1.16's ``GRPOTrainer`` extends it (``GRPORollouts``, a base of ``PPOTrainer``): a caller's own
sampling (``rollout_func``), an environment per rollout reset before sampling (``environment_factory``,
``fastppo.environments``), and the turns after each tool call (``tools``, ``fastppo.tools``: tool episodes, sampled
turn by turn or each chunk's whole in one static KV cache), with the rollout built from their token lists. Any run
may use them (``--tools`` on the command line too); ``PPOTrainer.rollout()`` calls them, and they read the trainer's
sampler (``_sample``, ``_sampling``, ``_decoder``, ``_lm``, ``_prompt_group``), config, tokenizer and stop ids.
Kept out of ``PPOTrainer``'s class so that it stays TRL 0.26's PPO trainer a reader can hold (issue 63 item 8).
"""
from __future__ import annotations

import torch

from fastppo import dist as fdist
from fastppo.data import chat_token_ids, left_pad
from fastppo.episode_decode import EpisodeDecode
from fastppo.errors import SettingsError
from fastppo.generation import cut_after_stop
from fastppo.rollout import Rollout, assemble
from fastppo.tools import Episodes, TurnLimits, run_episodes


class GRPORollouts:
    """TRL GRPO's rollout sources on a ``PPOTrainer`` (whose attributes its methods read: ``rollout_func``,
    ``_environments``, ``tool_calling``, ``reward_logs``, the sampler's methods)."""

    ROLLOUT_FUNC_KEYS = ("prompt_ids", "completion_ids", "logprobs")

    def _custom_rollout(self, rows, messages=None):
        """TRL GRPO's ``rollout_func(prompts, trainer)``: called with this process's prompts (each row's ``prompt``,
        as the dataset holds it, a group's num_generations copies side by side; ``messages`` in its place when
        environments were reset), it returns ``prompt_ids``, ``completion_ids`` and ``logprobs`` (one list per
        prompt; None where it has none), optionally ``env_mask`` (1 on the model's tokens, 0 on its environment's:
        those are not trained), and any other keys, which reach the reward functions as columns. With tools, as in
        TRL, the completion is the episode's first turn and is trained whole: an ``env_mask`` is then only a column.
        Returns (the rollout, the rows with those columns, the sampler's log-probs as [B, T], NaN where none)."""
        records = [dict(row) for row in rows]
        prompts = messages or [row.get("prompt", row.get(self.config.dataset_text_field)) for row in records]
        out = self.rollout_func(prompts, self)
        if not isinstance(out, dict):
            raise SettingsError(f"rollout_func must return a dict, got {type(out).__name__}")
        missing = [k for k in self.ROLLOUT_FUNC_KEYS if k not in out]
        if missing:
            raise SettingsError(f"rollout_func must return keys {sorted(missing)} in its output dict.")
        env_mask = out.get("env_mask") if self.tool_calling is None else None
        extra = {k: v for k, v in out.items() if k not in self.ROLLOUT_FUNC_KEYS and (k != "env_mask" or env_mask is None)}
        n, vocab = len(prompts), len(self.tokenizer)
        columns = {"prompt_ids": out["prompt_ids"], "completion_ids": out["completion_ids"],
                   **({"env_mask": env_mask} if env_mask is not None else {})}
        for key, value in columns.items():
            if not isinstance(value, (list, tuple)) or len(value) != n:
                raise SettingsError(f"rollout_func's {key!r} must hold one list per prompt ({n}), got "
                                    f"{len(value) if isinstance(value, (list, tuple)) else type(value).__name__}")
        for key in ("prompt_ids", "completion_ids"):
            bad = next(((i, t) for i, ids in enumerate(out[key]) for t in ids if not 0 <= int(t) < vocab), None)
            if bad is not None:
                raise SettingsError(f"rollout_func's {key}[{bad[0]}] holds token id {bad[1]}, outside the "
                                    f"tokenizer's vocabulary (0..{vocab - 1})")
        completions = [list(ids) for ids in out["completion_ids"]]
        masks = env_mask or [[1] * len(ids) for ids in completions]
        if any(len(m) != len(ids) for m, ids in zip(masks, completions)):
            raise SettingsError("rollout_func's env_mask must be as long as each completion's ids")
        queries, query_mask = left_pad([list(p) for p in out["prompt_ids"]], self.tokenizer.pad_token_id,
                                       self.config.pad_to_multiple_of)
        rollout = self._rollout_of(queries.to(self.device), query_mask.to(self.device), completions, masks)
        sampled = torch.full(rollout.responses.shape, float("nan"))
        for i, row in enumerate(out["logprobs"] or [None] * n):
            if row is not None and len(row) != len(completions[i]):
                raise SettingsError(f"rollout_func's logprobs[{i}] holds {len(row)} values for "
                                    f"{len(completions[i])} completion tokens")
            if row is not None:
                sampled[i, :len(row)] = torch.tensor([float("nan") if v is None else float(v) for v in row])
        for key, value in extra.items():  # TRL's extra fields: a list per prompt, or one value for all
            if key in rows.column_names:
                rows = rows.remove_columns(key)
            rows = rows.add_column(key, list(value) if isinstance(value, (list, tuple)) and len(value) == n
                                   else [value] * n)
        return rollout, rows, sampled.to(self.device)

    def _reset_environments(self, rows):
        """Each rollout's environment (``environments.Environments``), reset with its row; the prompts as they then
        read (a reset's string appended to the last message), rendered with the rollout's tools; the environments,
        each rollout's tools and the prompts' messages."""
        records = [dict(row) for row in rows]
        messages = [row.get("prompt") or [{"role": "user", "content": ""}] for row in records]
        if not all(isinstance(m, list) and m and isinstance(m[-1], dict) for m in messages):
            raise SettingsError("environment_factory needs conversational prompts (lists of chat messages: a reset's "
                                "text is appended to the last one)")
        instances, names = self._environments.assign(records)
        messages = self._environments.reset(instances, records, messages)
        limit = self.config.max_prompt_length
        ids = []
        for m, name in zip(messages, names):
            if self.tool_calling is not None:
                prompt = self.tool_calling.prompt_ids(m, self._environments.tools[name])
            else:
                prompt = chat_token_ids(self.tokenizer, m, add_generation_prompt=True,
                                        **(self.config.chat_template_kwargs or {}))
            ids.append(prompt if limit is None else prompt[-limit:])
        return ids, instances, [self._environments.row_tools(i) for i in instances], messages

    def _episodes_in_cache(self, synced: bool) -> bool:
        """Whether fastppo's own episodes are sampled whole, each chunk's in one static KV cache
        (``episode_decode``): with tools and the compiled decode, over a cache that keeps every column."""
        decoder = None if self.tool_calling is None or synced else self._decoder()
        return decoder is not None and decoder.keeps_every_column()

    def _tool_episodes(self, rollout: Rollout | None, queries, query_mask, temperature: float, synced: bool,
                       row_tools=None):
        """The rollout's first turns carried on through their tool calls (``tools.run_episodes``; ``rollout`` None:
        the first turns too, each chunk's episodes in one static KV cache): the completions of every turn, the
        template's tool-message tokens in them left out of training (the rollout's train mask), within
        ``response_length``; TRL's ``tools/call_frequency`` and ``tools/failure_frequency`` logged (every process's
        calls over every process's completions)."""
        pad, stops = self.tokenizer.pad_token_id, self.stop_ids
        limits = TurnLimits(self.config.response_length, getattr(self.config, "max_tool_calling_iterations", None),
                            tuple(stops))

        def sample(rows, contexts: list[list[int]], suffixes, length: int) -> list[list[int]]:
            ids, mask = left_pad(contexts, pad, self.config.pad_to_multiple_of)
            tokens = self._sample(ids.to(self.device), mask.to(self.device), length, temperature, synced)
            return [cut_after_stop(row, stops) for row in tokens.tolist()]

        if rollout is None:
            episodes = self._cached_episodes(queries, query_mask, temperature, limits, row_tools)
        else:
            prompts, first = rollout.token_ids()
            episodes = run_episodes(self.tool_calling, prompts, first, sample, limits, row_tools, synced,
                                    self.device)
        counts = fdist.all_reduce(torch.tensor([float(episodes.calls), float(episodes.failures),
                                                float(len(episodes.completions))], device=self.device))
        self.reward_logs.log_tool_counts(*counts.tolist())
        return self._rollout_of(queries, query_mask, episodes.completions, episodes.model_tokens), episodes

    def _cached_episodes(self, queries, query_mask, temperature: float, limits: TurnLimits, row_tools) -> Episodes:
        """Each chunk of ``local_rollout_forward_batch_size`` rows sampled whole, first turn to last, in one static
        KV cache of the compiled decode (``episode_decode.EpisodeDecode``): a turn after tool messages prefills only
        them; the chunk's tools run together."""
        chunk, real = self.config.local_rollout_forward_batch_size, query_mask.bool().cpu()
        prompts = [q[m].tolist() for q, m in zip(queries.cpu(), real)]
        parts = []
        for start in range(0, len(prompts), chunk):
            rows = slice(start, start + chunk)
            decode = EpisodeDecode(self._decoder(), self._lm(), queries[rows], query_mask[rows], limits.budget,
                                   self._sampling(temperature), self._prompt_group())
            parts.append(run_episodes(self.tool_calling, prompts[rows], decode.first_turn(), decode, limits,
                                      None if row_tools is None else row_tools[rows]))
        return Episodes.joined(parts)

    def _rollout_of(self, queries, query_mask, completions: list[list[int]], trained: list[list[int]]) -> Rollout:
        """The rollout of completions given as token lists (a multi-turn episode's, a rollout_func's) after the
        left-padded ``queries``: ``trained`` marks each completion's tokens to train (0: a tool's or environment's),
        and a completion has stopped where its last token is a stop token."""
        n, width = len(completions), max(1, max(map(len, completions), default=1))
        responses = torch.full((n, width), self.tokenizer.pad_token_id, dtype=queries.dtype)
        real = torch.zeros(n, width, dtype=torch.bool)
        mask = torch.zeros(n, width, dtype=torch.bool)
        for i, (ids, marks) in enumerate(zip(completions, trained)):
            responses[i, :len(ids)] = torch.tensor(ids, dtype=queries.dtype)
            real[i, :len(ids)] = True
            mask[i, :len(ids)] = torch.tensor([bool(m) for m in marks], dtype=torch.bool)
        has_stop = torch.tensor([bool(ids) and ids[-1] in self.stop_ids for ids in completions])
        device = queries.device
        return assemble(queries, query_mask, responses.to(device), real.to(device), has_stop.to(device),
                        mask.to(device))
