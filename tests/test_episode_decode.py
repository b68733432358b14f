"""Multi-turn episodes in one static KV cache (``fastppo.episode_decode``): a turn after tool messages prefills only
them, every turn of every round runs the first turn's bucket (one capture, nothing recompiled), and the tokens are
those of the sampler that prefills each episode anew, for the same random state: with turns of unequal lengths and
counts, rows that stop, rows that go on, a refill when the columns run out, a repetition penalty, and through the
trainer. On a CPU the graph backend's step runs uncaptured (``test_graph_decode``); on CUDA it is captured."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fastppo.data import left_pad
from fastppo.episode_decode import EpisodeDecode
from fastppo import generation
from fastppo.generation import Sampling, cut_after_stop, sample_responses
from fastppo.sampling import Truncation, process_logits
from fastppo.static_decode import StaticDecoder
from fastppo.tools import ToolRound, TurnLimits, run_episodes
from test_static_decode import frequent_tokens, left_padded

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


class ScriptedCalls:
    """``tools.ToolCalling``'s part that ``run_episodes`` reads, scripted: most turns call a tool, and each tool
    message's tokens depend on the row and the round (1 to 7 of them), so the episodes' contexts differ in length."""

    def __init__(self, vocab: int):
        self.vocab, self.rounds = vocab, 0

    def parse(self, ids, prefix, tools=None) -> dict:
        message = {"role": "assistant", "content": ""}
        if (len(prefix) + 2 * len(ids)) % 4:  # most turns call a tool; which ones follows from the tokens
            message["tool_calls"] = [{"row": len(prefix), "turn": len(ids)}]
        return message

    def run(self, calls, tools=None) -> ToolRound:
        self.rounds += 1
        messages = [None if c is None else [{"role": "tool", "content": f"{i}:{self.rounds}"}]
                    for i, c in enumerate(calls)]
        return ToolRound(messages, sum(c is not None for c in calls), 0)

    def suffix_ids(self, messages) -> list[int]:
        row, round_ = map(int, messages[0]["content"].split(":"))
        n = 1 + (3 * row + 2 * round_) % 7
        return [(17 * row + 5 * round_ + 3 * k) % (self.vocab - 3) + 3 for k in range(n)]


def prefilling_sampler(lm, stops, truncation=None):
    """The sampler that prefills each context anew (the trainer's eager path)."""

    def sample(rows, contexts, suffixes, length):
        ids, mask = left_pad(contexts, 0)
        tokens = sample_responses(lm, ids.to(lm.device), mask.to(lm.device), length,
                                  Sampling(1.0, stops, 0, truncation=truncation), len(contexts))
        return [cut_after_stop(row, stops) for row in tokens.tolist()]

    return sample


def both_episodes(lm, decoder, ids, mask, limits, seed, truncation=None):
    """The same episodes through ``EpisodeDecode`` and through the prefilling sampler, from one random state; each
    draw's processed logits of the rows still sampling must be the same up to rounding, draw by draw."""
    prompts = [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu())]
    stops = list(limits.stop_ids)
    drawn = {"cached": [], "prefilled": []}
    draw_tokens = generation.draw_tokens

    def recording(into):
        def draw(logits, temperature, done, *args):
            into.append(process_logits(logits, temperature, truncation, args[-1])[~done].float().cpu())
            return draw_tokens(logits, temperature, done, *args)
        return draw

    with pytest.MonkeyPatch.context() as patch:
        torch.manual_seed(seed)
        patch.setattr(generation, "draw_tokens", recording(drawn["cached"]))
        decode = EpisodeDecode(decoder, lm, ids, mask, limits.budget, Sampling(1.0, stops, 0, truncation=truncation))
        cached = run_episodes(ScriptedCalls(lm.config.vocab_size), prompts, decode.first_turn(), decode, limits)
        torch.manual_seed(seed)
        patch.setattr(generation, "draw_tokens", recording(drawn["prefilled"]))
        first = sample_responses(lm, ids, mask, limits.budget, Sampling(1.0, stops, 0, truncation=truncation),
                                 ids.shape[0])
        prefilled = run_episodes(ScriptedCalls(lm.config.vocab_size), prompts,
                                 [cut_after_stop(row, stops) for row in first.tolist()],
                                 prefilling_sampler(lm, stops, truncation), limits)
    assert len(drawn["cached"]) == len(drawn["prefilled"])
    for step, (a, b) in enumerate(zip(drawn["cached"], drawn["prefilled"])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"draw {step}")
    return cached, prefilled, decode


def turns(episodes) -> list[int]:
    return [len(m) for m in episodes.messages]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_turns_are_the_prefilling_samplers_and_run_one_bucket(model_dir, device, attention, monkeypatch):
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention).to(device)
    ids, mask = left_padded(5, 9, lm.config.vocab_size, [0, 3, 6, 1, 8], device, torch.Generator().manual_seed(2))
    stops = frequent_tokens(lm, ids, mask, k=40)
    prefills = []
    original = EpisodeDecode._prefill
    monkeypatch.setattr(EpisodeDecode, "_prefill", lambda self, rows, ahead: prefills.append(
        [len(a) for a in ahead]) or original(self, rows, ahead))
    decoder = StaticDecoder(lm, backend="cuda_graph", capture=device == "cuda")
    cached, prefilled, decode = both_episodes(lm, decoder, ids, mask, TurnLimits(40, 4, tuple(stops)), seed=3)
    assert cached.completions == prefilled.completions
    assert cached.model_tokens == prefilled.model_tokens
    assert len(set(turns(cached))) > 1 and max(turns(cached)) >= 3, "turns of unequal counts, some rows going on"
    # one bucket for every turn: the first turn's (5 rows → 8; 9 + 2 × 40 → 128 columns), captured once
    assert list(decoder._graphed) == [(8, 128)] and decode.state.key == (8, 128)
    # each round after the first turn prefilled only its tool messages and the stop token the sampler drew last
    assert prefills and all(2 <= n <= 8 for rows in prefills for n in rows), prefills


@pytest.mark.parametrize("device", DEVICES)
def test_a_round_that_would_pass_the_last_column_refills_the_cache(model_dir, device, monkeypatch):
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    ids, mask = left_padded(6, 6, lm.config.vocab_size, [0, 2, 4, 1, 3, 5], device, torch.Generator().manual_seed(8))
    stops = frequent_tokens(lm, ids, mask, k=30)
    refills = []
    original = EpisodeDecode._refill
    monkeypatch.setattr(EpisodeDecode, "_refill", lambda self, rows, contexts: refills.append(len(rows)) or
                        original(self, rows, contexts))
    # a cache of exactly 6 + 2 × 24 columns: the gaps that unequal turns leave fill it within a few rounds
    decoder = StaticDecoder(lm, backend="cuda_graph", capture=device == "cuda", cache_bucket=1)
    cached, prefilled, decode = both_episodes(lm, decoder, ids, mask, TurnLimits(24, 6, tuple(stops)), seed=4)
    assert refills, "no round needed the cache refilled"
    assert cached.completions == prefilled.completions and max(turns(cached)) >= 3
    assert list(decoder._graphed) == [(8, 54)]


def test_a_repetition_penalty_reads_each_episodes_own_tokens(model_dir):
    # a stopped row is fed the pad id while the others go on; its next turn's penalty must not count it
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids, mask = left_padded(4, 7, lm.config.vocab_size, [0, 1, 5, 2], "cpu", torch.Generator().manual_seed(6))
    stops = frequent_tokens(lm, ids, mask, k=40)
    truncation = Truncation(top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.5)
    decoder = StaticDecoder(lm, backend="cuda_graph", capture=False)
    cached, prefilled, _ = both_episodes(lm, decoder, ids, mask, TurnLimits(32, 3, tuple(stops)), seed=9,
                                         truncation=truncation)
    assert cached.completions == prefilled.completions and max(turns(cached)) >= 3


def test_the_trainer_samples_each_chunks_episodes_in_one_cache_and_trains_as_it_does_eagerly(tmp_path):
    """GRPOTrainer with tools, its compiled decode (the graph backend's step, uncaptured here) against the eager
    sampler that prefills every turn anew: the same episodes, so the same weights after two steps, bit for bit. The
    sampler's end-of-turn logit is raised by a hook so that turns end and call tools (``ScriptedCalls``)."""
    import datasets
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastppo import GRPOConfig, GRPOTrainer
    from tool_script import byte_tokenizer, multiply

    def train(cached: bool):
        tok = byte_tokenizer()
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
        data = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} times 4?"}]
                                                      for i in range(4)]})
        args = GRPOConfig(output_dir=str(tmp_path / str(cached)), num_generations=2, per_device_train_batch_size=4,
                          max_completion_length=48, max_steps=2, bf16=False, report_to="none", disable_tqdm=True,
                          save_strategy="no", learning_rate=0.05, logging_steps=1, max_tool_calling_iterations=3,
                          seed=1)
        trainer = GRPOTrainer(model=model, processing_class=tok, args=args, train_dataset=data, tools=[multiply],
                              reward_funcs=lambda completions, **k: [float(len(c)) for c in completions])
        trainer.tool_calling = ScriptedCalls(len(tok))
        raised = torch.zeros(len(tok))
        raised[tok.eos_token_id] = 5.0  # the sampler's forward only: the trainer's log-probs read the LM head itself
        model.lm_head.register_forward_hook(lambda module, args, out: out + raised)
        if cached:
            trainer._compiled_decode = True
            trainer._static_decoder = StaticDecoder(trainer._lm(), backend="cuda_graph", capture=False)
        episodes = []
        tool_episodes = trainer._tool_episodes
        trainer._tool_episodes = lambda *a: (lambda out: episodes.append(out[1]) or out)(tool_episodes(*a))
        trainer.train()
        return trainer, episodes

    eager, eager_episodes = train(False)
    cached, cached_episodes = train(True)
    assert [e.completions for e in cached_episodes] == [e.completions for e in eager_episodes]
    assert max(len(m) for e in cached_episodes for m in e.messages) >= 3, "no episode went past its first call"
    assert len(cached._static_decoder._graphed) == 1  # every turn of both steps ran one bucket
    for (name, a), b in zip(eager.actor_critic.state_dict().items(), cached.actor_critic.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_inductor_step_compiles_once_for_every_turn(model_dir):
    """The inductor backend (a CPU's): one compile for the first turn, and no recompilation after it, however the
    rounds' prefills, masks and rows differ (dynamo raises on a recompile here)."""
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids, mask = left_padded(3, 7, lm.config.vocab_size, [0, 4, 2], "cpu", torch.Generator().manual_seed(12))
    stops = frequent_tokens(lm, ids, mask, k=40)
    decoder = StaticDecoder(lm, backend="inductor")
    with torch._dynamo.config.patch(error_on_recompile=True):
        cached, prefilled, _ = both_episodes(lm, decoder, ids, mask, TurnLimits(20, 3, tuple(stops)), seed=5)
    assert cached.completions == prefilled.completions and max(turns(cached)) >= 3
    assert list(decoder.compile_seconds) == [(4, 64)]


def test_idle_and_padding_rows_keep_their_positions_within_the_model(monkeypatch):
    """Rows that stop calling tools, and the bucket's padding rows, are fed masked-out ids while the others go on; their
    positions must not grow with those rounds: GPT-2's learned position table has ``n_positions`` rows, which the
    prompts and one budget fit, and a position past it is an index error."""
    from transformers import GPT2Config, GPT2LMHeadModel

    class OneRowCalls(ScriptedCalls):
        def parse(self, ids, prefix, tools=None) -> dict:  # only the third prompt's row keeps calling
            return {"role": "assistant", "content": "", **({"tool_calls": [{}]} if prefix[0] == 9 else {})}

    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=48)).eval()
    prompts, budget, stop = [[7] * 4, [8] * 5, [9] * 6], 40, 1
    ids, mask = left_pad(prompts, 0)
    raised = torch.zeros(4, 1, 64)  # rows 0, 1 never stop (a first turn of the whole budget); row 2's turns are short
    raised[:2, 0, stop], raised[2:, 0, stop] = -1e4, 3.0
    lm.lm_head.register_forward_hook(lambda module, args, out: out + raised[:out.shape[0]])
    highest = []
    lm.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: highest.append(kwargs["position_ids"].max(1).values), with_kwargs=True)
    decode = EpisodeDecode(StaticDecoder(lm, backend="cuda_graph", capture=False), lm, ids, mask, budget,
                           Sampling(1.0, [stop], 0))
    episodes = run_episodes(OneRowCalls(64), prompts, decode.first_turn(), decode, TurnLimits(budget, None, (stop,)))
    assert [len(c) for c in episodes.completions][:2] == [budget] * 2 and len(episodes.messages[2]) >= 5
    assert int(torch.stack(highest).max()) < ids.shape[1] + budget <= lm.config.n_positions


def test_a_sliding_window_cache_is_refused():
    """A sliding window counts the masked-out columns too, so its episodes cannot share columns: the decoder says
    so (the trainer then prefills each turn anew) and ``EpisodeDecode`` refuses it by name."""
    from transformers import MistralConfig, MistralForCausalLM

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    windowed = MistralForCausalLM(MistralConfig(**shape, sliding_window=8))
    full = MistralForCausalLM(MistralConfig(**shape, sliding_window=None))
    assert not StaticDecoder(windowed).keeps_every_column() and StaticDecoder(full).keeps_every_column()
    ids, mask = left_pad([[5, 6, 7]], 0)
    with pytest.raises(ValueError, match="MistralForCausalLM's has sliding-window"):
        EpisodeDecode(StaticDecoder(windowed), windowed, ids, mask, 8, Sampling(1.0, [1], 0))
