"""The TRL 1.x patch (``fastppo.integrations.trl``): nested applies keep the outer one on, undo restores modules
imported while it was on, and a second apply with other options names the active patch."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.usefixtures("reference_path")


def _in_trl1(script: str) -> str:
    """``script`` in TRL 1.16's environment (a subprocess with TRL 1.x's directory first on PYTHONPATH, as
    tests/test_trl1_integration.py runs it); its stdout."""
    from test_trl1_integration import ROOT, trl1_dir

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(trl1_dir()), str(ROOT)]), TRITON_INTERPRET="0",
               TRL_EXPERIMENTAL_SILENCE="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


TRL1_PRELUDE = (
    "import sys, types\n"
    "import trl.trainer.utils as u\n"
    "from fastppo.integrations.trl import (FastppoChunkedLogProb, apply_fastppo_kernels_to_trl as apply,\n"
    "                                      remove_fastppo_kernels_from_trl)\n"
    "orig = {n: getattr(u, n) for n in ('_ChunkedLogProbFunction', 'selective_log_softmax', 'entropy_from_logits',\n"
    "                                   'selective_log_softmax_and_entropy')}\n"
    "def routed(): return {n for n in orig if getattr(u, n) is not orig[n]}\n"
)


def test_nested_trl_patches_keep_the_outer_one_on():
    """The example: leaving an inner ``with apply_fastppo_kernels_to_trl():`` removed the outer block's routing.
    Other members: a bare second apply() undone before the first; undo() twice on one patch (it releases its own
    hold only); remove_fastppo_kernels_from_trl() ends every hold."""
    out = _in_trl1(TRL1_PRELUDE + (
        "with apply() as outer:\n"
        "    with apply() as inner:\n"
        "        assert inner is not outer and inner.active and outer.active and len(routed()) == 4\n"
        "    assert not inner.active and outer.active and len(routed()) == 4, routed()\n"
        "    assert u._ChunkedLogProbFunction is FastppoChunkedLogProb\n"
        "assert routed() == set() and not outer.active\n"
        "first, second = apply(), apply()\n"
        "second.undo(); second.undo()  # twice: the first patch's hold is not released by it\n"
        "assert first.active and len(routed()) == 4 and u._ChunkedLogProbFunction is FastppoChunkedLogProb\n"
        "first.undo()\n"
        "assert routed() == set()\n"
        "a, b = apply(), apply()\n"
        "remove_fastppo_kernels_from_trl()\n"
        "assert routed() == set() and not a.active and not b.active\n"
        "a.undo(); b.undo()  # nothing left to release\n"
        "c = apply(logits_helpers=False)\n"
        "assert routed() == {'_ChunkedLogProbFunction'}\n"
        "c.undo()\n"
        "import fastppo.integrations.trl as integration  # fastppo's own names are never 'restored' to TRL's\n"
        "assert integration.FastppoChunkedLogProb is FastppoChunkedLogProb is not orig['_ChunkedLogProbFunction']\n"
        "print('ok', repr(c))\n"))
    assert "ok TRLKernelPatch(trl 1.16.0, fused_lm_head=True, logits_helpers=False, undone" in out


def test_undo_restores_modules_imported_while_the_patch_was_on():
    """The example: ``trl.experimental.cpo`` imported with the patch on took fastppo's selective_log_softmax by
    name and kept it after undo(). Other members: orpo and the other trainer modules that import a helper by name,
    and a user's module holding a helper under another name; a module imported before the patch is routed and
    restored too."""
    out = _in_trl1(TRL1_PRELUDE + (
        "import trl.experimental.sdft.loss_utils as before\n"
        "p = apply()\n"
        "assert before.selective_log_softmax is u.selective_log_softmax is not orig['selective_log_softmax']\n"
        "import trl.experimental.cpo.cpo_trainer as cpo, trl.experimental.orpo.orpo_trainer as orpo\n"
        "import trl.experimental.a2po.a2po_trainer as a2po, trl.experimental.sdpo.loss_utils as sdpo\n"
        "late = [cpo, orpo, a2po, sdpo]\n"
        "assert all(m.selective_log_softmax is u.selective_log_softmax for m in late)\n"
        "mine = types.ModuleType('my_rl_code'); sys.modules['my_rl_code'] = mine\n"
        "mine.logp = u.selective_log_softmax; mine.head = u._ChunkedLogProbFunction\n"
        "p.undo()\n"
        "assert routed() == set()\n"
        "for m in late + [before]:\n"
        "    assert m.selective_log_softmax is orig['selective_log_softmax'], m.__name__\n"
        "assert mine.logp is orig['selective_log_softmax'] and mine.head is orig['_ChunkedLogProbFunction']\n"
        "print('ok')\n"))
    assert out.strip().endswith("ok")


def test_a_second_apply_with_other_options_names_the_active_patch():
    """The example: apply(fused_lm_head=False) while the default patch is on returned the active patch, with the
    old options, silently. Other member: the same from inside a with block; the refusal changes nothing."""
    out = _in_trl1(TRL1_PRELUDE + (
        "p = apply()\n"
        "for kwargs in ({'fused_lm_head': False}, {'logits_helpers': False}):\n"
        "    try:\n"
        "        apply(**kwargs)\n"
        "    except RuntimeError as e:\n"
        "        print('refused:', e)\n"
        "    else:\n"
        "        raise AssertionError(kwargs)\n"
        "assert p.active and len(routed()) == 4\n"
        "p.undo()\n"
        "with apply(fused_lm_head=False) as q:\n"
        "    try:\n"
        "        apply()\n"
        "    except RuntimeError as e:\n"
        "        print('refused:', e)\n"
        "    assert routed() == {'selective_log_softmax', 'entropy_from_logits', 'selective_log_softmax_and_entropy'}\n"
        "assert routed() == set()\n"))
    refusals = [line for line in out.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 3
    assert all("already routed into TRL 1.16.0 with fused_lm_head=" in r and "Undo the active patch" in r
               for r in refusals)
    assert "this call asks for fused_lm_head=False, logits_helpers=True" in refusals[0]
    assert "trl.trainer.utils._ChunkedLogProbFunction" in refusals[0]
