"""AutoModelForCausalLMWithValueHead and create_reference_model as legacy TRL (<= 0.11) has them, on tiny
random GPT-2, Llama, GPT-NeoX and OPT models built here (OPT with a projection: its head reads
word_embed_proj_dim, not hidden_size)."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    OPTConfig,
)

from fastppo.value_head import VALUE_HEAD_FILE, AutoModelForCausalLMWithValueHead, create_reference_model

VOCAB = 64
IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "vocab_size": VOCAB}
CONFIGS = {
    "gpt2": lambda: GPT2Config(n_layer=3, n_embd=16, n_head=2, n_positions=64, **IDS),
    "llama": lambda: LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                                 num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False,
                                 **IDS),
    "gpt_neox": lambda: GPTNeoXConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                      num_attention_heads=2, max_position_embeddings=64, **IDS),
    "opt": lambda: OPTConfig(hidden_size=16, word_embed_proj_dim=8, ffn_dim=32, num_hidden_layers=3,
                             num_attention_heads=2, max_position_embeddings=64, **IDS),
}
ARCHS = list(CONFIGS)
HEAD_WIDTH = {"gpt2": 16, "llama": 16, "gpt_neox": 16, "opt": 8}


def layers_of(lm: nn.Module) -> nn.ModuleList:
    """The decoder layers, found by module type rather than by name."""
    return next(m for m in lm.modules() if isinstance(m, nn.ModuleList))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """One saved random causal LM per architecture."""
    root = tmp_path_factory.mktemp("lms")
    paths = {}
    for i, (arch, config) in enumerate(CONFIGS.items()):
        torch.manual_seed(100 + i)
        paths[arch] = str(root / arch)
        AutoModelForCausalLM.from_config(config()).save_pretrained(paths[arch])
    return paths


def random_ids(batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length))


def head_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.v_head.state_dict().items()}


def assert_same_head(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() == {"summary.weight", "summary.bias"}
    for k, v in a.items():
        torch.testing.assert_close(v, b[k], atol=0, rtol=0)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        torch.testing.assert_close(v, b[k], atol=0, rtol=0, msg=k)


def randomize_head(model) -> None:
    """A head no fresh init could reproduce, so a reload that drops it cannot pass."""
    with torch.no_grad():
        model.v_head.summary.weight.normal_(0.0, 3.0)
        model.v_head.summary.bias.fill_(float(torch.randn(())) + 5.0)


# ---------------------------------------------------------------------------- the class and its forward


def test_class_attributes_are_legacy_trls():
    cls = AutoModelForCausalLMWithValueHead
    assert cls.transformers_parent_class is AutoModelForCausalLM
    assert {"lm_head", "embed_out", "output_layer"} <= set(cls.lm_head_namings)
    assert cls.supported_args == ("summary_dropout_prob", "v_head_initializer_range", "v_head_init_strategy")


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_returns_logits_loss_and_the_heads_value(arch, checkpoints):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints[arch]).eval()
    lm = AutoModelForCausalLM.from_pretrained(checkpoints[arch]).eval()
    assert model.v_head.summary.weight.shape == (1, HEAD_WIDTH[arch])
    assert model.v_head.summary.weight.dtype == torch.float32
    assert model.v_head.summary.bias.abs().item() > 0  # nn.Linear's random init, not zeros
    ids = random_ids()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    logits, loss, value = model(input_ids=ids, attention_mask=mask)
    ref = lm(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    torch.testing.assert_close(logits, ref.logits.float(), atol=0, rtol=0)
    assert loss is None and value.shape == ids.shape and value.dtype == torch.float32
    w, b = model.v_head.summary.weight.double(), model.v_head.summary.bias.double()
    expected = (ref.hidden_states[-1].double() @ w.T + b).squeeze(-1)
    torch.testing.assert_close(value.double(), expected, atol=1e-5, rtol=1e-5)
    _, loss, _ = model(ids, labels=ids)
    torch.testing.assert_close(loss, lm(ids, labels=ids).loss)
    out = model(ids, return_past_key_values=True)
    assert len(out) == 4 and out[3] is not None


def test_forward_takes_legacy_trls_argument_order(checkpoints):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["gpt2"]).eval()
    ids = random_ids(1, 6)
    first = model(ids[:, :4], return_past_key_values=True)
    # (input_ids, past_key_values, attention_mask): the cache continues the first four tokens
    cont, _, value, _ = model(ids[:, 4:], first[3], torch.ones_like(ids), return_past_key_values=True)
    full, _, full_value = model(ids)
    torch.testing.assert_close(cont, full[:, 4:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(value, full_value[:, 4:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["gpt2"])
def test_generate_passes_through(arch, checkpoints):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints[arch]).eval()
    ids = random_ids(2, 5)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert out.shape == (2, 9) and torch.equal(out[:, :5], ids)
    lm = AutoModelForCausalLM.from_pretrained(checkpoints[arch]).eval()
    assert torch.equal(out, lm.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None))


# ---------------------------------------------------------------------------- from_pretrained's arguments


@pytest.mark.parametrize("arch", ARCHS)
def test_from_a_model_object_wraps_that_object(arch, checkpoints):
    lm = AutoModelForCausalLM.from_pretrained(checkpoints[arch])
    model = AutoModelForCausalLMWithValueHead.from_pretrained(lm)
    assert model.pretrained_model is lm and model.config is lm.config
    assert not model.is_peft_model and not model.is_sequential_parallel and model.current_device in ("cpu", 0)


def test_value_head_kwargs_are_split_from_transformers_kwargs(checkpoints):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        checkpoints["llama"], summary_dropout_prob=0.25, v_head_init_strategy="normal",
        v_head_initializer_range=1e-3, attn_implementation="eager")
    assert model.v_head.dropout.p == 0.25
    assert model.config._attn_implementation == "eager"  # reached transformers
    assert torch.count_nonzero(model.v_head.summary.bias) == 0
    weight = model.v_head.summary.weight
    assert 0 < weight.abs().max() < 1e-2  # N(0, 1e-3) over 16 values; nn.Linear's init is ~0.25 wide
    default = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["llama"], v_head_init_strategy="normal")
    assert 0.05 < default.v_head.summary.weight.std() < 0.5  # std 0.2
    assert AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["llama"]).v_head.dropout.p == 0.1


def test_dropout_from_the_config_wins_as_in_legacy_trl(checkpoints):
    lm = AutoModelForCausalLM.from_pretrained(checkpoints["gpt2"])
    lm.config.summary_dropout_prob = 0.3
    assert AutoModelForCausalLMWithValueHead.from_pretrained(lm, summary_dropout_prob=0.7).v_head.dropout.p == 0.3
    lm.config.summary_dropout_prob = None  # present but None: no dropout at all
    assert isinstance(AutoModelForCausalLMWithValueHead.from_pretrained(lm).v_head.dropout, nn.Identity)
    lm2 = AutoModelForCausalLM.from_pretrained(checkpoints["gpt2"])
    assert AutoModelForCausalLMWithValueHead(lm2, summary_dropout_prob=0.0).v_head.dropout.__class__ is nn.Identity


def test_bad_value_head_arguments_are_named(checkpoints):
    with pytest.raises(ValueError, match="v_head_init_strategy='xavier'"):
        AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["gpt2"], v_head_init_strategy="xavier")
    lm = AutoModelForCausalLM.from_pretrained(checkpoints["gpt2"])
    with pytest.raises(TypeError, match="summary_dropout"):
        AutoModelForCausalLMWithValueHead(lm, summary_dropout=0.5)


@pytest.mark.parametrize(("arch", "key"), [("gpt2", "torch_dtype"), ("gpt_neox", "dtype")])
def test_dtype_reaches_the_lm_and_the_head_stays_fp32(arch, key, checkpoints):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints[arch], **{key: torch.bfloat16}).eval()
    heads = [getattr(model.pretrained_model, n) for n in model.lm_head_namings if hasattr(model.pretrained_model, n)]
    assert heads and all(h.weight.dtype == torch.bfloat16 for h in heads)
    assert all(p.dtype == torch.bfloat16 for p in model.pretrained_model.parameters())
    assert model.v_head.summary.weight.dtype == torch.float32
    ids = random_ids()
    logits, _, value = model(ids)
    assert logits.dtype == value.dtype == torch.float32
    hidden = model.pretrained_model(ids, output_hidden_states=True).hidden_states[-1]
    expected = hidden.float() @ model.v_head.summary.weight.T + model.v_head.summary.bias  # cast, then fp32 matmul
    torch.testing.assert_close(value, expected.squeeze(-1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_model_without_an_lm_head_is_refused(arch):
    base = AutoModel.from_config(CONFIGS[arch]())
    with pytest.raises(ValueError, match="does not have a language model head"):
        AutoModelForCausalLMWithValueHead.from_pretrained(base)
    with pytest.raises(ValueError, match="does not have a language model head"):
        AutoModelForCausalLMWithValueHead(base)


@pytest.mark.parametrize("bad", [42, nn.Linear(4, 4), {"model": "gpt2"}])
def test_a_non_model_argument_is_refused(bad):
    with pytest.raises(ValueError, match=f"pretrained_model_name_or_path .* is {type(bad).__name__}"):
        AutoModelForCausalLMWithValueHead.from_pretrained(bad)


def test_a_wrapper_is_not_wrapped_twice(checkpoints):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["gpt2"])
    with pytest.raises(ValueError, match="AutoModelForCausalLMWithValueHead"):
        AutoModelForCausalLMWithValueHead.from_pretrained(model)


def test_a_device_map_that_offloads_is_refused(checkpoints):
    lm = AutoModelForCausalLM.from_pretrained(checkpoints["gpt2"])
    lm.hf_device_map = {"transformer": "cpu", "lm_head": "disk"}
    with pytest.raises(ValueError, match="offloaded"):
        AutoModelForCausalLMWithValueHead.from_pretrained(lm)
    lm.hf_device_map = {"": "cpu"}  # all on one device: no offload
    model = AutoModelForCausalLMWithValueHead.from_pretrained(lm)
    assert model.is_sequential_parallel
    assert model(random_ids())[2].shape == (2, 7)


# ---------------------------------------------------------------------------- state dicts


@pytest.mark.parametrize("arch", ARCHS)
def test_state_dict_is_the_lms_plus_the_head(arch, checkpoints):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints[arch])
    state = model.state_dict()
    lm_state = model.pretrained_model.state_dict()
    assert list(state) == [*lm_state, "v_head.summary.weight", "v_head.summary.bias"]
    for k, v in lm_state.items():
        assert state[k] is v or torch.equal(state[k], v)
    assert state["v_head.summary.weight"].data_ptr() == model.v_head.summary.weight.data_ptr()


@pytest.mark.parametrize("layout", ["legacy", "module"])
def test_load_state_dict_takes_both_layouts(layout, checkpoints):
    source = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["gpt_neox"])
    randomize_head(source)
    with torch.no_grad():
        for p in source.pretrained_model.parameters():
            p.add_(torch.randn_like(p))
    state = source.state_dict()
    if layout == "module":  # nn.Module's own names, as older fastppo checkpoints hold them
        state = {("" if k.startswith("v_head.") else "pretrained_model.") + k: v for k, v in state.items()}
    keys = list(state)
    target = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["gpt_neox"])
    result = target.load_state_dict(state)  # strict
    assert not result.missing_keys and not result.unexpected_keys
    assert_same_weights(target.state_dict(), source.state_dict())
    assert list(state) == keys  # the caller's dict is not renamed


def test_as_a_submodule_the_layout_round_trips(checkpoints):
    """Nested (the trainer's actor-critic, DeepSpeed's checkpoints): the wrapper's keys under the parent's prefix."""
    source = nn.ModuleDict({"policy": AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["llama"]),
                            "other": nn.Linear(3, 2)})
    randomize_head(source["policy"])
    state = source.state_dict()
    expected = [f"policy.{k}" for k in source["policy"].pretrained_model.state_dict()]
    assert list(state) == [*expected, "policy.v_head.summary.weight", "policy.v_head.summary.bias",
                           "other.weight", "other.bias"]
    target = nn.ModuleDict({"policy": AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["llama"]),
                            "other": nn.Linear(3, 2)})
    target.load_state_dict(state)  # strict
    assert_same_weights(target.state_dict(), state)


# ---------------------------------------------------------------------------- saving and loading back


@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_reload_with_this_class_and_with_transformers(arch, checkpoints, tmp_path):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints[arch])
    randomize_head(model)
    model.save_pretrained(str(tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert_same_head({k[len("v_head."):]: v for k, v in saved.items() if k.startswith("v_head.")}, head_of(model))
    reloaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    assert_same_weights(reloaded.state_dict(), model.state_dict())
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert_same_weights(plain.state_dict(), model.pretrained_model.state_dict())


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_sharded_save_reloads_the_head_from_its_shard(arch, checkpoints, tmp_path):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints[arch])
    randomize_head(model)
    model.save_pretrained(str(tmp_path), max_shard_size="8KB")
    with open(tmp_path / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) > 1 and not (tmp_path / "model.safetensors").exists()
    assert {"v_head.summary.weight", "v_head.summary.bias"} <= set(weight_map)
    reloaded = AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path)  # a Path works too
    assert_same_weights(reloaded.state_dict(), model.state_dict())
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert_same_weights(plain.state_dict(), model.pretrained_model.state_dict())


@pytest.mark.parametrize("sharded", [False, True])
def test_a_legacy_pytorch_model_bin_head_loads(sharded, checkpoints, tmp_path):
    """Legacy TRL wrote pytorch_model.bin (or .bin shards with an index) with v_head.* among the LM's keys."""
    lm = AutoModelForCausalLM.from_pretrained(checkpoints["llama"])
    lm.config.save_pretrained(tmp_path)
    head = {"v_head.summary.weight": torch.randn(1, 16), "v_head.summary.bias": torch.randn(1)}
    state = {**lm.state_dict(), **head}
    if sharded:
        keys = list(state)
        shards = {"pytorch_model-00001-of-00002.bin": keys[: len(keys) // 2],
                  "pytorch_model-00002-of-00002.bin": keys[len(keys) // 2:]}
        for name, names in shards.items():
            torch.save({k: state[k].contiguous() for k in names}, tmp_path / name)
        index = {"metadata": {}, "weight_map": {k: name for name, names in shards.items() for k in names}}
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    else:
        torch.save(state, tmp_path / "pytorch_model.bin")
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    assert_same_head(head_of(model), {k[len("v_head."):]: v for k, v in head.items()})
    assert_same_weights(model.pretrained_model.state_dict(), lm.state_dict())


def test_a_checkpoint_without_a_head_gets_a_fresh_one(checkpoints):
    torch.manual_seed(5)
    a = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["gpt2"])
    torch.manual_seed(6)
    b = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["gpt2"])
    assert not torch.equal(a.v_head.summary.weight, b.v_head.summary.weight)


def test_a_head_in_the_hub_cache_loads_offline(checkpoints, tmp_path, monkeypatch):
    import huggingface_hub.constants

    # offline mode (else transformers itself retries the Hub for adapter_config.json for ~20 s)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["gpt_neox"])
    randomize_head(model)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--someone--tiny-ppo"
    model.save_pretrained(str(repo / "snapshots" / commit))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    reloaded = AutoModelForCausalLMWithValueHead.from_pretrained(
        "someone/tiny-ppo", cache_dir=str(tmp_path / "cache"), local_files_only=True)
    assert_same_weights(reloaded.state_dict(), model.state_dict())


def test_push_to_hub_is_refused_clearly(checkpoints):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["gpt2"])
    with pytest.raises(NotImplementedError, match="push_to_hub .*save_pretrained"):
        model.push_to_hub("someone/model")


# ---------------------------------------------------------------------------- PEFT


@pytest.fixture
def lora():
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def test_peft_adapter_and_head_save_and_reload(lora, checkpoints, tmp_path):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["llama"], peft_config=lora)
    assert model.is_peft_model
    randomize_head(model)
    with torch.no_grad():
        for name, p in model.pretrained_model.named_parameters():
            if "lora_B" in name:  # zero at init: give the adapter weights a reload could lose
                p.normal_()
    state = model.state_dict()
    assert "v_head.summary.weight" in state and any("lora_B" in k for k in state)
    model.save_pretrained(str(tmp_path))
    files = set(os.listdir(tmp_path))
    assert {"adapter_config.json", "adapter_model.safetensors", VALUE_HEAD_FILE} <= files
    assert "model.safetensors" not in files
    frozen = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    assert frozen.is_peft_model
    assert_same_weights(frozen.state_dict(), state)
    lora_params = [p for n, p in frozen.pretrained_model.named_parameters() if "lora_" in n]
    assert lora_params and not any(p.requires_grad for p in lora_params)  # legacy TRL: is_trainable=False
    trainable = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path), is_trainable=True)
    assert all(p.requires_grad for n, p in trainable.pretrained_model.named_parameters() if "lora_" in n)


def test_peft_config_must_be_a_peft_config(lora, checkpoints):
    with pytest.raises(ValueError, match="peft_config should be a peft.PeftConfig, but is dict"):
        AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["llama"], peft_config={"r": 2})


def test_a_reward_adapter_scores_as_its_reward_model(lora, checkpoints, tmp_path):
    """Legacy TRL's reward_adapter: a PEFT reward model's adapter on the policy's base, for compute_reward_score."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    reward = AutoModelForSequenceClassification.from_pretrained(checkpoints["llama"], num_labels=1)
    reward = get_peft_model(reward, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                               task_type="SEQ_CLS"))
    with torch.no_grad():
        for name, p in reward.named_parameters():
            if "lora_B" in name or "score" in name:
                p.normal_()
    reward.eval().save_pretrained(str(tmp_path / "rm"))
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["llama"], peft_config=lora,
                                                              reward_adapter=str(tmp_path / "rm"))
    assert model.supports_rm_adapter and model.rm_adapter_name == "reward_adapter"
    ids = random_ids()
    scores = model.compute_reward_score(ids)
    assert scores.shape == (2, 7, 1)
    torch.testing.assert_close(scores[:, -1, :], reward(ids).logits, atol=1e-5, rtol=1e-5)
    assert not model.score.weight.requires_grad
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_" in n and "reward_adapter" not in n for n in trainable)  # the policy's adapter is back on
    assert not any("reward_adapter" in n for n in trainable) and "v_head.summary.weight" in trainable
    assert model.pretrained_model.active_adapter == "default"
    with pytest.raises(ValueError, match="reward_adapter can only be used with a PEFT model"):
        AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["llama"], reward_adapter=str(tmp_path / "rm"))
    with pytest.raises(ValueError, match="reward_adapter should be a local path or Hub id"):
        AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["llama"], reward_adapter=reward)
    with pytest.raises(ValueError, match="no reward adapter"):
        AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["llama"]).compute_reward_score(ids)


# ---------------------------------------------------------------------------- create_reference_model


def train_step(model, lr: float = 0.1) -> None:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    ids = random_ids()
    _, loss, value = model(ids, labels=ids)
    (loss + value.pow(2).mean()).backward()
    optimizer.step()


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ARCHS)
def test_reference_model_is_a_frozen_independent_copy(arch, checkpoints):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints[arch]).train()
    ref = create_reference_model(model)
    assert type(ref) is type(model) and not ref.training and model.training
    assert all(not p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in model.parameters())  # the model itself is left alone
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, ref_params[name]) and p.data_ptr() != ref_params[name].data_ptr()
    before = snapshot(ref)
    train_step(model)
    assert_same_weights(snapshot(ref), before)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize(("arch", "num_shared_layers"), [(arch, 1) for arch in ARCHS] + [("llama", 2)])
def test_shared_layers_are_frozen_in_the_model_and_equal_to_the_reference(arch, num_shared_layers, checkpoints):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints[arch]).train()
    layers = layers_of(model.pretrained_model)
    ref = create_reference_model(model, num_shared_layers=num_shared_layers)
    # legacy TRL's split: every parameter registered before layer n's first one (embeddings, layers 0..n-1)
    params = list(model.parameters())
    first = next(i for i, p in enumerate(params) if p is next(layers[num_shared_layers].parameters()))
    shared = {id(p) for p in params[:first]}
    assert {id(p) for layer in layers[:num_shared_layers] for p in layer.parameters()} < shared
    assert {id(p) for p in model.pretrained_model.get_input_embeddings().parameters()} < shared
    for p in model.parameters():
        assert p.requires_grad == (id(p) not in shared)
    assert all(not p.requires_grad for p in ref.parameters()) and not ref.training
    ref_before, model_before = snapshot(ref), snapshot(model)
    train_step(model, lr=1.0)
    assert_same_weights(snapshot(ref), ref_before)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if id(p) in shared:  # frozen: still the reference's values (held apart: a copy, as in legacy TRL)
            assert torch.equal(p, ref_params[name]) and p.data_ptr() != ref_params[name].data_ptr()
    changed = {id(p) for n, p in model.named_parameters() if not torch.equal(p, model_before[n])}
    assert {id(p) for p in layers[num_shared_layers].parameters()} & changed  # the first unshared layer trains
    assert id(model.v_head.summary.weight) in changed


def test_a_custom_pattern_picks_the_layer(checkpoints):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["gpt2"])
    create_reference_model(model, num_shared_layers=2, pattern="pretrained_model.transformer.h.{layer}.")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and frozen[-1].startswith("pretrained_model.transformer.h.1.")
    assert all(".h.2." not in n for n in frozen)


def test_reference_model_errors_name_the_argument(checkpoints):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["llama"])
    with pytest.raises(ValueError, match="num_shared_layers=3: layer pattern could not be matched"):
        create_reference_model(model, num_shared_layers=3)  # layers 0..2
    with pytest.raises(ValueError, match="pattern='model.layer.{layer}'"):
        create_reference_model(model, num_shared_layers=1, pattern="model.layer.{layer}")
    assert all(p.requires_grad for p in model.parameters())  # a refused call freezes nothing


def test_reference_model_is_refused_under_deepspeed_zero3(checkpoints, monkeypatch):
    import fastppo.value_head as M

    model = AutoModelForCausalLMWithValueHead.from_pretrained(checkpoints["gpt2"])
    monkeypatch.setattr(M, "is_deepspeed_zero3_enabled", lambda: True)
    with pytest.raises(ValueError, match="ZeRO-3"):
        create_reference_model(model)
