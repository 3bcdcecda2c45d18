"""The translation predictor's API refuses bad arguments with one :class:`DynaseqError`
(never an error from deep inside torch or SentencePiece), and answers a line with no
subwords with an empty line, as it answers an empty one."""

from __future__ import annotations

import math
import warnings

import pytest

from dynaseq.core.arguments import check_text
from dynaseq.core.errors import DynaseqError
from dynaseq.tasks.translation.predictor import Translator

from helpers import calibrated_cct


@pytest.fixture(scope="module")
def t(trained_run):
    return Translator.load(trained_run)


@pytest.mark.parametrize("kwargs, message", [
    ({"beam": 0}, "beam must be an integer >= 1, got 0"),
    ({"beam": 1.5}, "beam must be an integer >= 1, got 1.5"),
    ({"beam": True}, "beam must be an integer >= 1, got True"),
    ({"batch_size": -1}, "batch_size must be an integer >= 1, got -1"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    ({"max_len_a": -1}, "max_len_a must be >= 0, got -1"),
    ({"max_len_a": math.nan}, "max_len_a must be a finite number, got nan"),
    ({"max_len_b": -5}, "max_len_b must be an integer >= 0, got -5"),
    ({"length_penalty": math.inf}, "length_penalty must be a finite number, got inf"),
])
def test_bad_search_settings_are_refused(t, kwargs, message):
    with pytest.raises(DynaseqError) as e:
        t.translate(["kalo mintu"], **kwargs)
    assert str(e.value) == message


@pytest.mark.parametrize("lines, message", [
    ("kalo mintu", "lines must be a list of strings, not str"),
    (None, "lines must be a list of strings, not NoneType"),
    (["kalo", None], "line 2 has type NoneType, not str"),
    (["kalo", 1], "line 2 has type int, not str"),
    (["a \udfff b"], "line 1 is not valid text: surrogates not allowed (\\udfff)"),
])
def test_lines_that_are_not_text_are_refused_everywhere(t, lines, message):
    for call in (lambda: t.translate(lines), lambda: t.score(lines, lines),
                 lambda: t.evaluate(lines, lines)):
        with pytest.raises(DynaseqError) as e:
            call()
        assert str(e.value) == message


@pytest.mark.parametrize("budget", [True, "0.5", (1.0, "0.5"), b"1", (True, 1.0), b"0.5",
                                    {0.5: "x", 0.5000001: "y"}, {0.5}])
def test_budgets_that_are_not_numbers_are_refused(budget):
    from dynaseq.tasks.encoder.budget import as_fraction
    from dynaseq.tasks.translation.predictor import budget_pair

    with pytest.raises(DynaseqError, match="a budget is one fraction or an"):
        budget_pair(budget)
    if not isinstance(budget, tuple):
        with pytest.raises(DynaseqError, match=r"a budget is a fraction in \(0, 1\]"):
            as_fraction(budget)
    assert budget_pair(0.5) == (0.5, 0.5) and as_fraction(1) == 1.0


def test_per_line_budgets_not_in_a_list_are_refused_with_the_way_to_give_them():
    import numpy as np

    from dynaseq.tasks.translation.predictor import budget_pair

    for budget in (np.array([0.5, 0.5, 0.5]), (1.0, 0.5, 0.5)):
        with pytest.raises(DynaseqError, match="; one budget per line is a list"):
            budget_pair(budget)


def test_nothing_to_evaluate_and_unequal_pairs_are_refused(t):
    with pytest.raises(DynaseqError, match="nothing to evaluate: no sentence pairs"):
        t.evaluate([], [])
    with pytest.raises(DynaseqError, match="source has 1 lines but reference has 2"):
        t.score(["a"], ["a", "b"])
    with pytest.raises(DynaseqError, match="every sentence pair has an empty source or target"):
        t.score(["kalo mintu", ""], ["", "sum 3 4"])  # no pair is empty: one side of each


def test_a_line_without_subwords_translates_to_an_empty_line(t):
    assert t.tokenizer.encode(["\u200b"]) == [[]]  # a zero-width space: no subword
    got = t.translate(["kalo mintu", "\u200b", " ", "sum 3 4"], beam=1)
    assert got[1:3] == ["", ""]
    assert [got[0], got[3]] == t.translate(["kalo mintu", "sum 3 4"], beam=1)
    assert t.tokenizer.encode_kept(["kalo", " ", "\u200b", "sum"])[0] == [0, 3]


def test_check_text_takes_any_sequence_of_strings():
    check_text(("a", "b"))
    check_text([])


def test_calibrate_takes_one_budget_refuses_a_bad_tolerance_and_warns_out_of_reach(
        cct_run, synthetic_paths, tmp_path):
    run, t, src, ref = calibrated_cct(cct_run, synthetic_paths, tmp_path, lines=8)
    for tol in (0, -1, 5, math.nan):
        with pytest.raises(DynaseqError, match=r"tol must be in \(0, 0.1\]"):
            t.calibrate(src, ref, budgets=[0.5], tol=tol)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a budget it reaches
        (one,) = t.calibrate(src, ref, budgets=0.4)
    assert one.budget == (0.4, 0.4)
    with pytest.warns(UserWarning, match="budget 1e-09, 1e-09 is out of reach: the closest "
                                         "realized compute is"):
        t.calibrate(src, ref, budgets=[1e-9])


def test_compute_and_scores_in_train_mode_are_those_of_eval_mode(cct_run, synthetic_paths):
    from dynaseq.data import read_lines

    t = Translator.load(cct_run[0])
    src = read_lines(synthetic_paths["valid.src"])[:8]
    ref = read_lines(synthetic_paths["valid.tgt"])[:8]
    compute, scores = t.realized_compute(src, ref, budget=0.5), t.score(src, ref, budget=0.5)
    assert scores["ppl"] == math.exp(scores["loss"])
    t.model.train()  # gates record what ran in eval mode only: the count switches to it
    assert t.realized_compute(src, ref, budget=0.5) == compute
    assert t.model.training


def test_a_budget_asked_twice_is_calibrated_once(cct_run, synthetic_paths, tmp_path):
    run, t, src, ref = calibrated_cct(cct_run, synthetic_paths, tmp_path, lines=8)
    fitted = t.calibrate(src, ref, budgets=[0.4, (0.4, 0.4), 0.5, 0.4 + 1e-9])
    assert [c.budget for c in fitted] == [(0.4, 0.4), (0.5, 0.5)]
    assert sorted(c.budget for c in t.calibrations) == [(0.4, 0.4), (0.5, 0.5)]


def test_numpy_and_torch_numbers_are_taken_as_python_numbers(cct_run):
    import numpy as np
    import torch

    t = Translator.load(cct_run[0])
    lines = ["kalo mintu sum 3 4 end", "sum 1 2 end", "rev 5 6 7 end"]
    want = t.translate(lines, budget=0.5, beam=2, batch_size=2)
    for budget in (np.float32(0.5), torch.tensor(0.5), (np.float64(0.5), 0.5),
                   np.array([0.5, 0.5]), torch.tensor([0.5, 0.5])):
        assert t.translate(lines, budget=budget, beam=np.int64(2),
                           batch_size=np.int32(2)) == want
    assert t.translate(lines, budget=[np.float32(1), 0.5, (1.0, np.float32(0.33))]) == [
        t.translate([line], budget=b)[0]
        for line, b in zip(lines, [1.0, 0.5, (1.0, 0.33)], strict=True)]


def test_a_translator_prints_as_one_short_line(t, trained_run):
    """``repr`` names the class, checkpoint, device and size (the dataclass default printed
    the module tree, the vocabulary and every calibration: ~9,000 characters)."""
    text = repr(t)
    assert text.startswith(f"Translator(checkpoint='{t.checkpoint}', device=cpu, params=")
    assert "\n" not in text and len(text) < 200 and str(t) == text
