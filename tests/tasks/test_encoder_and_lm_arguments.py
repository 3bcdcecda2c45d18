"""The classification and language-model predictors refuse bad arguments with one
:class:`DynaseqError`, and their results do not depend on the batch size."""

from __future__ import annotations

import math

import pytest

import dynaseq
from dynaseq.core.errors import DynaseqError
from dynaseq.train.loop import train

from encoder_helpers import classify_config
from helpers import lm_config


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, sst2_small):
    run = tmp_path_factory.mktemp("clf") / "run"
    train(classify_config(run, sst2_small, "train.max_steps=2"), progress=False)
    return dynaseq.load(run)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    cfg = lm_config(tmp_path_factory.mktemp("lm"), "train.max_steps=2")
    train(cfg, progress=False)
    return dynaseq.load(cfg.run_dir)


@pytest.mark.parametrize("call, message", [
    (lambda c, dev: c.classify(["a film"], batch_size=-1),
     "batch_size must be an integer >= 1, got -1"),
    (lambda c, dev: c.classify(["a film"], batch_size=0),
     "batch_size must be an integer >= 1, got 0"),
    (lambda c, dev: c.evaluate(dev, batch_size=1.5), "batch_size must be an integer >= 1"),
    (lambda c, dev: c.classify("a film"), "lines must be a list of strings (or of pairs), "
                                          "not str"),
    (lambda c, dev: c.classify(None), "not NoneType"),
    (lambda c, dev: c.classify(["a", None]), "line 2 has type NoneType, not str"),
    (lambda c, dev: c.classify(["a \udfff"]), "line 1 is not valid text"),
    (lambda c, dev: c.classify(["", ""], batch_size=0), "batch_size must be an integer >= 1"),
    (lambda c, dev: c.classify([], batch_size=-1), "batch_size must be an integer >= 1"),
    (lambda c, dev: c.evaluate("/nonexistent.tsv", batch_size=0),
     "batch_size must be an integer >= 1"),
    (lambda c, dev: c.evaluate(None), "path must be a file path, got NoneType"),
])
def test_the_classifier_refuses_bad_arguments(classifier, sst2_small, call, message):
    with pytest.raises(DynaseqError) as e:
        call(classifier, sst2_small["dev"])
    assert message in str(e.value)


def test_classification_does_not_depend_on_the_batch_size(classifier, sst2_small):
    lines = ["a fine film", "bad", "an ok one that runs on", "x", "the end"]
    assert classifier.classify(lines, batch_size=2) == classifier.classify(lines, batch_size=5)
    assert (classifier.evaluate(sst2_small["dev"], batch_size=3)["accuracy"]
            == classifier.evaluate(sst2_small["dev"])["accuracy"])


def test_a_blank_line_of_tabs_is_skipped_like_one_of_spaces(classifier):
    assert classifier.classify(["\t", " \t ", "   ", "a fine film"])[:3] == [None] * 3
    with pytest.raises(DynaseqError, match="line 1: sst2 takes one sentence per line, got 2"):
        classifier.classify(["a fine\tfilm"])


@pytest.mark.parametrize("kwargs, message", [
    ({"n_tokens": -1}, "n_tokens must be an integer >= 0, got -1"),
    ({"n_tokens": 1.5}, "n_tokens must be an integer >= 0, got 1.5"),
    ({"temperature": math.nan}, "temperature must be a finite number, got nan"),
    ({"temperature": -1}, "temperature must be >= 0, got -1"),
    ({"seed": -1}, "seed must be an integer in [0, 18446744073709551615], got -1"),
    ({"seed": 2**70}, "seed must be an integer in [0, 18446744073709551615]"),
    ({"top_k": 0}, "top_k must be an integer >= 1, got 0"),
    ({"top_k": True}, "top_k must be an integer >= 1, got True"),
    ({"prompt": 123}, "prompt has type int, not str"),
    ({"prompt": "a \udfff"}, "prompt is not valid text"),
])
def test_generate_refuses_bad_arguments(lm, kwargs, message):
    with pytest.raises(DynaseqError) as e:
        lm.generate(**{"prompt": "the", "n_tokens": 3, **kwargs})
    assert message in str(e.value)


def test_generate_takes_any_64_bit_seed_and_a_top_k_past_the_vocabulary(lm):
    assert lm.generate("the", 3, seed=2**64 - 1) == lm.generate("the", 3, seed=2**64 - 1)
    assert (lm.generate("the", 3, top_k=10**6, seed=1)
            == lm.generate("the", 3, top_k=None, seed=1))  # no filter either way


def test_generate_at_a_vanishing_temperature_is_greedy(lm):
    greedy = lm.generate("the", 6, temperature=0.0)
    assert lm.generate("the", 6, temperature=1e-300, seed=5) == greedy
    assert lm.generate("the", 6, temperature=5e-324, seed=9) == greedy


def test_generate_of_no_tokens_is_the_prompt_alone(lm):
    assert lm.generate("the game", 0) == "the game"
    assert lm.generate(None, 0) == lm.generate("", 0) == ""
    text = lm.generate("the", 4, seed=3)
    assert text.startswith("the ") and not text.endswith(" ")


def test_lm_evaluate_refuses_bad_arguments(lm):
    for kwargs, message in (({"batch_size": -1}, "batch_size must be an integer >= 1"),
                            ({"max_tokens": 0}, "max_tokens must be an integer >= 1")):
        with pytest.raises(DynaseqError, match=message):
            lm.evaluate("valid", **kwargs)
    with pytest.raises(DynaseqError, match="a split name or a file path, got NoneType"):
        lm.evaluate(None)
