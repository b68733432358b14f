"""One torchrun rank of a PPOTrainer run, for the multi-process tests (DDP and DeepSpeed).

    torchrun --nproc_per_node 2 tests/ppo_worker.py SETTINGS_JSON OUTPUT_DIR STOP_AT fresh|resume

``STOP_AT`` > 0: a callback stops training after that iteration (0: run to the end); ``resume`` continues
from ``latest``. The final model is saved to OUTPUT_DIR at the end of ``train()`` (``save_model()``). Test-only
keys in the settings: ``_nan_iteration`` N makes rank 1's first loss of iteration N non-finite (the step must be
skipped on every rank); ``_save_final`` writes each rank's final weights (``actor_critic``, ``policy``,
``value``) and ``log_history`` to ``final<RANK>.pt`` in the output directory; ``_log_sharing`` writes each
iteration's ``update_sharing`` and ``reference_sharing`` group size (None: unshared) to ``sharing<RANK>.json``.
"""
import faulthandler
import json
import os
import sys

faulthandler.dump_traceback_later(280, exit=True)  # a hung rank prints every thread's stack, then exits

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import fastppo.train as T  # noqa: E402
from fastppo import PPOConfig, PPOTrainer  # noqa: E402


def main() -> None:
    settings, out, stop_at, resume = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "resume"
    nan_iteration = settings.pop("_nan_iteration", 0)
    save_final = settings.pop("_save_final", False)
    log_sharing = settings.pop("_log_sharing", False)

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = 0 < stop_at <= state.global_step
            return control

    class SaveModel(TrainerCallback):
        """The final model, as a TRL script saves it after train() (train() writes only checkpoints), here at
        train's end, a callback's way to save (under ZeRO-3 a gather from every process)."""

        def on_train_end(self, args, state, control, **kwargs):
            trainer.save_model()

    trainer = PPOTrainer(args=PPOConfig(**settings, output_dir=out,
                                        resume_from_checkpoint="latest" if resume else None),
                         callbacks=[Stop(), SaveModel()])
    if nan_iteration:
        losses, fired = T.ppo_losses, []

        def poisoned(*args, **kwargs):
            loss, stats = losses(*args, **kwargs)
            if trainer.state.global_step == nan_iteration - 1 and not fired and os.environ["RANK"] == "1":
                fired.append(True)
                loss = loss * float("nan")
            return loss, stats

        T.ppo_losses = poisoned
    if log_sharing:  # each iteration's update_sharing and reference_sharing, as this rank decided them
        decided = {"update": [], "reference": []}
        for name in decided:
            def record(*args, _f=getattr(T, f"{name}_sharing"), _name=name, **kwargs):
                out = _f(*args, **kwargs)
                decided[_name].append(None if out is None else out[0])
                return out
            setattr(T, f"{name}_sharing", record)
    trainer.train()
    if log_sharing:
        with open(os.path.join(out, f"sharing{os.environ['RANK']}.json"), "w") as f:
            json.dump(decided, f)
    if save_final:
        def copy(module):
            return None if module is None else {k: v.detach().clone() for k, v in module.state_dict().items()}

        torch.save({"actor_critic": copy(trainer.actor_critic), "policy": copy(trainer.policy),
                    "value": copy(trainer.value_model), "log_history": trainer.state.log_history},
                   os.path.join(out, f"final{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main()
