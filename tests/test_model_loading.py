"""How models are loaded: sdpa attention by default, and eager where a model has no sdpa (GPT-OSS, DeBERTa) and the
user did not choose the attention; a choice the user made is kept, and its failure reported."""
from __future__ import annotations

import pytest
from transformers import GptOssConfig, GptOssForCausalLM

from fastppo.config import ModelConfig
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
