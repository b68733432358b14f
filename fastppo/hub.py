"""``trainer.push_to_hub()``, as transformers' ``Trainer.push_to_hub`` (which TRL's trainers inherit): the model is
saved to ``output_dir`` first (nothing is lost if the upload fails), a model card (``README.md``) is written beside
it, and the directory goes to the Hub through ``huggingface_hub`` (``create_repo``, ``upload_folder``) on the
main process, honouring the config's ``hub_model_id``, ``hub_private_repo``, ``hub_strategy``, ``hub_token`` and
``hub_revision``. Pushing during training (``push_to_hub=True``) stays refused (``fastppo.checks``)."""
from __future__ import annotations

import os
from pathlib import Path

from fastppo.checkpoint import checkpoints
from fastppo.errors import SettingsError

# transformers' hub_strategy values: what push_to_hub uploads besides the final model ("every_save" pushes during
# training in transformers, which fastppo does not: at the end it is "end")
HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
# never uploaded: fastppo's lock and a save a crash interrupted (hidden), transformers' "_*" (as its push_to_hub)
ALWAYS_IGNORED = [".*", "_*", "**/.*"]
# a model card fastppo wrote says so, and only such a card is written over (a README.md of the user's is uploaded
# as it is)
CARD_MARK = "<!-- model card written by fastppo's push_to_hub -->"


def push_to_hub(trainer, commit_message: str | None = "End of training", blocking: bool = True,
                token: str | None = None, revision: str | None = None, private: bool | None = None,
                model_name: str | None = None):
    """Save ``trainer``'s model to its output_dir, write the model card, upload the directory; returns
    ``upload_folder``'s ``CommitInfo`` (a ``Future`` of it with ``blocking=False``; None on other processes).
    Offline or without a token: a SettingsError naming what is missing, after the save."""
    args = trainer.args
    strategy = str(getattr(args.hub_strategy, "value", args.hub_strategy))
    if strategy not in HUB_STRATEGIES:
        raise SettingsError(f"hub_strategy={strategy!r}: one of {', '.join(HUB_STRATEGIES)}")
    trainer.save_model()  # every process (ZeRO-3 gathers); the model is safe locally before any upload
    if not trainer.dist.is_main:
        return None
    output_dir = args.output_dir
    token = token if token is not None else args.hub_token
    _require_hub(token, output_dir)
    from huggingface_hub import HfApi

    repo_id = args.hub_model_id or Path(output_dir).absolute().name
    write_model_card(trainer, output_dir, model_name or repo_id.split("/")[-1], repo_id)
    api = HfApi()
    try:
        repo_id = api.create_repo(repo_id, token=token, private=args.hub_private_repo if private is None else private,
                                  exist_ok=True).repo_id
        revision = revision if revision is not None else args.hub_revision
        newest = checkpoints(output_dir)[-1][1] if checkpoints(output_dir) else None
        if strategy == "checkpoint" and newest is not None:  # transformers' last-checkpoint, to resume from
            api.upload_folder(repo_id=repo_id, folder_path=newest, path_in_repo="last-checkpoint",
                              commit_message="Training in progress, checkpoint", token=token, revision=revision,
                              ignore_patterns=ALWAYS_IGNORED)
        ignored = ALWAYS_IGNORED + ([] if strategy == "all_checkpoints" else ["checkpoint-*", "checkpoint-*/**"])
        return api.upload_folder(repo_id=repo_id, folder_path=output_dir, commit_message=commit_message,
                                 token=token, revision=revision, ignore_patterns=ignored + ["latest"],
                                 run_as_future=not blocking)
    except Exception as e:  # the Hub's and the network's errors, said with where the model is
        raise RuntimeError(f"push_to_hub: uploading {output_dir!r} to {repo_id!r} failed ({type(e).__name__}: {e}); "
                           f"the model is saved in {output_dir!r}") from e


def _require_hub(token: str | None, output_dir: str) -> None:
    """Offline, or no token anywhere huggingface_hub looks: a SettingsError saying what is missing."""
    try:
        from huggingface_hub import constants, get_token
    except ImportError as e:  # pragma: no cover  (a transformers dependency)
        raise SettingsError(f"push_to_hub needs huggingface_hub; the model is saved in {output_dir!r}") from e
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE") or constants.HF_HUB_OFFLINE
    if offline:
        raise SettingsError(f"push_to_hub: the Hub is offline (HF_HUB_OFFLINE is set); the model is saved in "
                            f"{output_dir!r}: unset HF_HUB_OFFLINE to upload it")
    if token is None and get_token() is None:
        raise SettingsError(f"push_to_hub: no Hugging Face token (pass hub_token= in the config or token= here, set "
                            f"HF_TOKEN, or run `hf auth login`); the model is saved in {output_dir!r}")


def write_model_card(trainer, output_dir: str, model_name: str, repo_id: str) -> None:
    """``output_dir/README.md``: the model, how it was trained (fastppo, the trainer, its base model), the versions;
    a README.md that fastppo did not write is the user's, and is kept."""
    path = os.path.join(output_dir, "README.md")
    if os.path.isfile(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            if CARD_MARK not in f.read():
                return
    with open(path, "w", encoding="utf-8") as f:
        f.write(model_card(trainer, model_name, repo_id))


def base_model_of(trainer) -> str | None:
    """The policy's Hub id (its config's ``_name_or_path``; a PEFT adapter's base model), None for a local model (a
    path names nothing on the Hub, as TRL's card leaves it out)."""
    lm = trainer._lm()
    name = getattr(getattr(lm, "config", None), "_name_or_path", None) or None
    return name if name and not os.path.isdir(name) and not os.path.isabs(name) else None


def model_card(trainer, model_name: str, repo_id: str) -> str:
    """The card's text: front matter (base model, tags naming fastppo and the algorithm), how to use the model,
    how it was trained, the versions."""
    import torch
    import transformers

    from fastppo import __version__

    algorithm = getattr(type(trainer), "run_suffix", "PPO")  # GRPOTrainer's GRPO, RLOOTrainer's RLOO
    base = base_model_of(trainer)
    front = ["---", *([f"base_model: {base}"] if base else []), "library_name: transformers",
             f"model_name: {model_name}", "tags:", "- fastppo", f"- {algorithm.lower()}", "- reinforcement-learning",
             "---"]
    origin = (f"a fine-tuned version of [{base}](https://huggingface.co/{base})" if base else
              "fine-tuned from a local model")
    state = trainer.state
    return "\n".join(front + [
        CARD_MARK, "", f"# Model Card for {model_name}", "",
        f"This model is {origin}. It has been trained with {algorithm} by "
        f"[fastppo](https://pypi.org/project/fastppo/)'s `{type(trainer).__name__}` (TRL's `{type(trainer).__name__}` "
        "API).", "",
        "## Quick start", "", "```python", "from transformers import pipeline", "",
        f'generator = pipeline("text-generation", model="{repo_id}")',
        'print(generator("Hello,", max_new_tokens=32)[0]["generated_text"])', "```", "",
        "## Training procedure", "",
        f"{algorithm} with fastppo: {state.global_step} steps over {state.episode} episodes.", "",
        "### Framework versions", "",
        f"- fastppo: {__version__}", f"- Transformers: {transformers.__version__}", f"- PyTorch: {torch.__version__}",
        ""])
