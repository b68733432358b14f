"""``trainer.push_to_hub()``, as transformers' Trainer has it (issue 60 item 8; it was an AttributeError): the model
saved to output_dir first, a model card naming fastppo, the trainer and the base model, the upload through
huggingface_hub with the config's hub settings (HfApi replaced here by a recorder: no network), and a clear error
offline or without a token, with the model saved all the same."""
from __future__ import annotations

import os
from types import SimpleNamespace

import datasets
import huggingface_hub
import pytest

from fastppo import GRPOConfig, GRPOTrainer, PPOTrainer
from fastppo.errors import SettingsError
from helpers import quick_config

pytestmark = pytest.mark.usefixtures("reference_path")


class RecordingApi:
    """huggingface_hub.HfApi's two calls push_to_hub makes, recorded with what the folder held at upload time."""

    calls: list = []

    def __init__(self, *args, **kwargs):
        pass

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        # the Hub puts a bare name under the token's user, and says so in the RepoUrl's repo_id
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"me/{repo_id}")

    def upload_folder(self, **kwargs):
        folder = kwargs["folder_path"]
        held = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, files in os.walk(folder) for f in files)
        readme = os.path.join(folder, "README.md")
        card = open(readme).read() if os.path.isfile(readme) else ""
        self.calls.append(("upload_folder", kwargs, held, card))
        return "commit"


@pytest.fixture
def hub(monkeypatch):
    RecordingApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return RecordingApi.calls


def grpo_trainer(tmp_path, model_dir, **kw):
    args = GRPOConfig(output_dir=str(tmp_path / "tiny-grpo"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=4, max_steps=1, bf16=False, gradient_checkpointing=False,
                      save_strategy="no", disable_tqdm=True, report_to="none", **kw)
    return GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                       train_dataset=datasets.Dataset.from_dict({"prompt": ["the movie was", "the plot"] * 4}))


def test_push_to_hub_saves_writes_a_card_and_uploads_with_the_hub_settings(tmp_path, model_dir, hub):
    trainer = grpo_trainer(tmp_path, model_dir, hub_model_id="someone/tiny-grpo", hub_private_repo=True,
                           hub_token="hf_test", hub_revision="dev")
    trainer._lm().config._name_or_path = "HuggingFaceTB/SmolLM2-135M"  # as a model loaded from the Hub says
    assert trainer.push_to_hub(commit_message="done") == "commit"
    (_, repo, create), (_, upload, held, card) = hub
    assert repo == "someone/tiny-grpo" and create == dict(token="hf_test", private=True, exist_ok=True)
    assert upload["repo_id"] == "someone/tiny-grpo" and upload["folder_path"] == str(tmp_path / "tiny-grpo")
    assert upload["token"] == "hf_test" and upload["revision"] == "dev" and upload["commit_message"] == "done"
    assert "checkpoint-*" in upload["ignore_patterns"] and upload["run_as_future"] is False
    assert "model.safetensors" in held and "config.json" in held and "README.md" in held  # saved before the upload
    assert "base_model: HuggingFaceTB/SmolLM2-135M" in card and "- fastppo" in card and "- grpo" in card
    assert "fastppo" in card and "`GRPOTrainer`" in card and "GRPO" in card


def test_hub_strategy_decides_which_checkpoints_go_and_a_users_readme_is_kept(tmp_path, model_dir, hub):
    trainer = PPOTrainer(args=quick_config(tmp_path, total_episodes=8, hub_token="hf_test", hub_strategy="checkpoint"))
    trainer.train()
    out = tmp_path / "out"
    trainer.push_to_hub()
    uploads = [c for c in hub if c[0] == "upload_folder"]
    assert hub[0][1] == "out"  # unset hub_model_id: output_dir's name, as transformers'
    assert [u[1]["repo_id"] for u in uploads] == ["me/out", "me/out"]
    assert [u[1].get("path_in_repo") for u in uploads] == ["last-checkpoint", None]
    assert uploads[0][1]["folder_path"] == str(out / "checkpoint-1")
    assert "- ppo" in uploads[1][3] and "`PPOTrainer`" in uploads[1][3] and "base_model" not in uploads[1][3]
    hub.clear()
    (out / "README.md").write_text("my own card")
    trainer.args.hub_strategy = "all_checkpoints"
    trainer.push_to_hub()
    upload, held, card = hub[1][1:]
    assert "checkpoint-*" not in upload["ignore_patterns"] and "checkpoint-1/model.safetensors" in held
    assert card == "my own card"  # a README.md fastppo did not write is the user's


def test_offline_or_without_a_token_push_to_hub_says_what_is_missing_and_the_model_is_saved(tmp_path, model_dir,
                                                                                           hub, monkeypatch):
    trainer = grpo_trainer(tmp_path, model_dir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SettingsError, match="push_to_hub: the Hub is offline .*HF_HUB_OFFLINE.*the model is saved in"):
        trainer.push_to_hub()
    assert (tmp_path / "tiny-grpo" / "model.safetensors").is_file() and hub == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(SettingsError, match="push_to_hub: no Hugging Face token .*hub_token="):
        trainer.push_to_hub()
    assert hub == []
