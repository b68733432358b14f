"""How models are loaded: sdpa attention by default, and eager where a model has no sdpa (GPT-OSS, DeBERTa) and the
user did not choose the attention; a choice the user made is kept, and its failure reported."""
from __future__ import annotations

import pytest
from transformers import GptOssConfig, GptOssForCausalLM

from fastppo.script_args import ModelConfig
from fastppo.errors import LoadError
from fastppo.loading import load_causal_lm


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss")
    config = GptOssConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=4, num_local_experts=4, num_experts_per_tok=2,
                          layer_types=["sliding_attention", "full_attention"], sliding_window=64, vocab_size=128,
                          max_position_embeddings=256)
    GptOssForCausalLM(config).save_pretrained(path)
    return str(path)


def test_a_model_without_sdpa_loads_with_eager_attention(gpt_oss, model_dir):
    assert load_causal_lm(model_dir, ModelConfig(), "policy").config._attn_implementation == "sdpa"
    assert load_causal_lm(gpt_oss, ModelConfig(), "policy").config._attn_implementation == "eager"
    with pytest.raises(LoadError, match="could not load the policy .*scaled_dot_product_attention"):
        load_causal_lm(gpt_oss, ModelConfig(attn_implementation="sdpa"), "policy")  # the user's choice is kept


@pytest.mark.parametrize("family", ["cohere", "granite"])
def test_a_model_that_scales_its_logits_gives_its_own_log_probs(tmp_path, family):
    """Cohere multiplies its logits by ``logit_scale``, Granite divides them by ``logits_scaling``: the fused head
    takes that scale through the hidden states (layout.head_input), so its log-probs, the fused policy loss's and
    the full KL's, are the model's own; the load-time head check passes."""
    import torch
    from transformers import AutoModelForCausalLM, CohereConfig, GraniteConfig

    from fastppo.actor_critic import PolicyAndValue
    from fastppo.layout import make_layout
    from fastppo.loading import check_lm_head

    common = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, max_position_embeddings=128)
    config = (CohereConfig(**common, logit_scale=0.3) if family == "cohere"
              else GraniteConfig(**common, logits_scaling=6.0))
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    check_lm_head(lm, config.vocab_size, torch.device("cpu"))  # the check that refused it before
    ids = torch.randint(0, config.vocab_size, (3, 9))
    with torch.no_grad():
        want = torch.log_softmax(lm(input_ids=ids).logits[:, 2:-1], -1).gather(-1, ids[:, 3:, None]).squeeze(-1)
        layout = make_layout(ids, 3, [3, 3, 3], [6, 6, 6], packed=False)
        got = PolicyAndValue(lm, None, critic=False)(layout, 1.0).logprobs
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    unscaled = torch.log_softmax(lm.lm_head(lm.model(input_ids=ids).last_hidden_state)[:, 2:-1], -1)
    assert (unscaled.gather(-1, ids[:, 3:, None]).squeeze(-1) - want).abs().max() > 1e-3  # the scale matters
