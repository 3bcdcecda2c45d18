"""The caller's torch settings do not change what a run answers. Inference runs under
``torch.inference_mode`` (no autograd bookkeeping per op); a run loaded and used inside the
caller's own ``torch.inference_mode``, or after ``torch.set_default_dtype``, answers the
same (before, the dtype check refused the float32 weights of a model built in float64).

Before, a lean decoder read every weight's version counter, which an inference tensor does
not keep: ``Translator.load(...).translate(...)`` inside ``with torch.inference_mode():``
raised "Inference tensors do not track version counter"."""

from __future__ import annotations

import shutil

import pytest
import torch

import dynaseq
from dynaseq.tasks.translation.predictor import Translator
from dynaseq.train.loop import train

from encoder_helpers import classify_config
from helpers import lm_config

LINES = ["kalo mintu sum 3 4 end", "sum 1 2 end", "rev 5 6 7 end"]
BUDGETS = [(1.0, 1.0), (0.5, 0.5), (1.0, 0.33)]


def _translations(run) -> list[list[str]]:
    t = Translator.load(run)
    return [t.translate(LINES, budget=BUDGETS), t.translate(LINES, budget=0.5, beam=3),
            t.translate(LINES[:1], budget=(1.0, 0.33))]


def test_a_translator_loaded_inside_inference_mode_answers_the_same(cct_run):
    run, _ = cct_run
    plain = _translations(run)
    with torch.inference_mode():
        inside = _translations(run)
    assert inside == plain
    assert all(any(s.strip() for s in out) for out in plain)


def test_decoding_runs_under_inference_mode_and_the_model_still_trains(cct_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(cct_run[0], run)
    t = Translator.load(run)
    lean = t.lean_decoder()
    assert lean is not None
    modes = []
    real = lean.output

    def output(x):
        modes.append(torch.is_inference_mode_enabled())
        return real(x)

    lean.output = output
    first = t.translate(LINES, budget=BUDGETS)
    assert modes and all(modes)
    assert not torch.is_inference_mode_enabled()
    # nothing the decode made is kept where training reads it: a backward pass runs
    model = t.model.train()
    src = torch.tensor([[5, 6, 7, model.eos_id]])
    tgt = torch.tensor([[model.bos_id, 8, 9]])
    out = model(src, tgt, 0)
    out.logits.float().logsumexp(-1).sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    with torch.no_grad():  # a changed weight: the lean decoder is prepared anew
        next(model.parameters()).add_(0.0)
    model.eval()
    assert not lean.is_current()
    assert t.translate(LINES, budget=BUDGETS) == first


@pytest.fixture(scope="module")
def lm_and_classifier(tmp_path_factory, sst2_small):
    root = tmp_path_factory.mktemp("inference_mode")
    (root / "lm").mkdir()
    lm = lm_config(root / "lm")
    train(lm, progress=False)
    clf = root / "clf"
    train(classify_config(clf, sst2_small), progress=False)
    return lm.run_dir, clf


def _answers(lm_run, clf_run) -> tuple:
    lm, clf = dynaseq.load(lm_run), dynaseq.load(clf_run)
    rows = ["a fine film .", "dull and slow ."]
    return (lm.generate("the", n_tokens=8, temperature=0.0),
            round(lm.evaluate("valid")["ppl"], 6), clf.classify(rows))


def test_a_language_model_and_a_classifier_inside_inference_mode_answer_the_same(
        lm_and_classifier):
    plain = _answers(*lm_and_classifier)
    with torch.inference_mode():
        inside = _answers(*lm_and_classifier)
    assert inside == plain


@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16])
def test_a_run_loads_as_trained_whatever_the_default_dtype(cct_run, default):
    plain = Translator.load(cct_run[0]).translate(LINES, budget=BUDGETS)
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        t = Translator.load(cct_run[0])
        assert next(t.model.parameters()).dtype == torch.float32
        assert t.translate(LINES, budget=BUDGETS) == plain
    finally:
        torch.set_default_dtype(before)


def test_weights_loaded_anew_inside_inference_mode_are_used(cct_run):
    """A run loaded inside the caller's inference mode has normal tensors (version counters),
    so new weights loaded in place are seen by the lean decoder's copies; a model built of
    inference tensors is never taken as unchanged."""
    from dynaseq.nn.versions import unchanged, versions_of

    with torch.inference_mode():
        t = Translator.load(cct_run[0])
        before = t.translate(LINES, budget=BUDGETS)
        assert not any(p.is_inference() for p in t.model.parameters())
        state = {k: v + 0.05 if v.is_floating_point() else v
                 for k, v in t.model.state_dict().items()}
        t.model.load_state_dict(state)
        after = t.translate(LINES, budget=BUDGETS)
        fresh = Translator.load(cct_run[0])
        fresh.model.load_state_dict(state)
        assert after == fresh.translate(LINES, budget=BUDGETS)
        assert after != before
        made = torch.ones(3)  # an inference tensor
    assert not unchanged([made], versions_of([made]))


def test_weights_given_new_storage_or_dtype_are_used(cct_run, lm_and_classifier):
    """``param.data = ...`` (what ``Module.to(dtype)`` does) moves no version counter; the
    lean decoder's and encoder's copies are still prepared anew, so the answers are the
    general path's (before: the old copies decoded on, or a dtype mismatch was raised)."""
    t = Translator.load(cct_run[0])
    t.translate(LINES, budget=BUDGETS)  # prepares the lean decoder
    with torch.no_grad():
        for p in t.model.parameters():
            p.data = p.data + 0.05 if p.is_floating_point() else p.data.clone()
    general = Translator.load(cct_run[0])
    general.model.load_state_dict(t.model.state_dict())
    general.fast_decode = False
    assert t.translate(LINES, budget=BUDGETS) == general.translate(LINES, budget=BUDGETS)
    t.model.to(torch.float64)
    general.model.to(torch.float64)
    assert t.translate(LINES, budget=BUDGETS) == general.translate(LINES, budget=BUDGETS)
    clf = dynaseq.load(lm_and_classifier[1])
    rows = ["a fine film .", "dull and slow ."]
    first = clf.classify(rows)  # prepares the lean encoder
    clf.model.to(torch.float64)
    assert clf.classify(rows) == first


def test_inside_the_callers_autocast_the_general_path_answers(cct_run, lm_and_classifier):
    """Inside ``torch.autocast`` the lean parts (products on float32 copies, buffers of
    the weights' dtype) step aside for the general path, which follows autocast; before,
    a batch of two lines raised a dtype error in the lean encoder."""
    t = Translator.load(cct_run[0])
    general = Translator.load(cct_run[0])
    general.fast_decode = False
    from dynaseq.models.lean import LeanDecoder, lean_or_model
    from dynaseq.models.lean_encoder import LeanEncoder

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert LeanDecoder.prepare(t.model) is None and lean_or_model(t.model) is t.model
        assert t.lean_decoder() is None
        assert t.translate(LINES, budget=BUDGETS) == general.translate(LINES, budget=BUDGETS)
        clf = dynaseq.load(lm_and_classifier[1])
        assert clf.lean_encoder() is None and len(clf.classify(["a fine film .", "dull ."])) == 2
        assert LeanEncoder.prepare(clf.model) is None
    assert t.lean_decoder() is not None and clf.lean_encoder() is not None
