"""Reading every GLUE layout as the GLUE download writes it, a column spec, and the bad
inputs (one line, exit status 2)."""

from __future__ import annotations

import pytest

from dynaseq.core.errors import DynaseqError
from dynaseq.tasks.classify.glue import GLUE_TASKS, read_table
from dynaseq.tasks.encoder.vocab import EncoderVocab

from helpers import SHARED_DATA

#: One header line and one row per task, as GLUE's train.tsv / dev.tsv hold them.
SAMPLES = {
    "cola": (None, "gj04\t1\t\tThe sailors rode the breeze.", "The sailors rode the breeze.",
             None, "1"),
    "sst2": ("sentence\tlabel", "a charming journey \t1", "a charming journey", None, "1"),
    "mrpc": ("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String",
             "1\t702876\t702977\tAmrozi accused his brother .\tReferring to him , Amrozi .",
             "Amrozi accused his brother .", "Referring to him , Amrozi .", "1"),
    "qqp": ("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
            "133273\t213221\t213222\tHow is the life?\tHow is life?\t0",
            "How is the life?", "How is life?", "0"),
    "stsb": ("index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
             "\tscore",
             "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\tAn "
             "air plane is taking off.\t5.000", "A plane is taking off.",
             "An air plane is taking off.", 5.0),
    "mnli": ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse"
             "\tsentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label",
             "0\t31193\t31193n\tgovernment\t( x )\t( y )\t(ROOT x)\t(ROOT y)\tConceptually "
             "cream skimming.\tProduct and geography.\tneutral\tneutral",
             "Conceptually cream skimming.", "Product and geography.", "neutral"),
    "qnli": ("index\tquestion\tsentence\tlabel", "0\tWhen?\tIn 1900.\tentailment", "When?",
             "In 1900.", "entailment"),
    "rte": ("index\tsentence1\tsentence2\tlabel", "0\tNo weapons.\tWeapons found.\t"
            "not_entailment", "No weapons.", "Weapons found.", "not_entailment"),
    "wnli": ("index\tsentence1\tsentence2\tlabel", "0\tI stuck a pin.\tI stuck the pin.\t1",
             "I stuck a pin.", "I stuck the pin.", "1"),
}


@pytest.mark.parametrize("task", sorted(GLUE_TASKS))
def test_every_glue_layout_reads(tmp_path, task):
    header, row, a, b, target = SAMPLES[task]
    path = tmp_path / f"{task}.tsv"
    path.write_text("".join(f"{line}\n" for line in (header, row, row) if line is not None))
    ex = read_table(path, GLUE_TASKS[task])
    assert len(ex) == 2 and ex.text_a == [a, a]
    assert ex.text_b == (None if b is None else [b, b])
    assert ex.targets() == [target, target]
    assert GLUE_TASKS[task].is_pair == (b is not None)


def test_the_shared_glue_files_read():
    sst = read_table(SHARED_DATA / "glue" / "SST-2" / "dev.tsv", GLUE_TASKS["sst2"])
    cola = read_table(SHARED_DATA / "glue" / "CoLA" / "dev.tsv", GLUE_TASKS["cola"])
    assert (len(sst), sst.skipped, len(cola), cola.skipped) == (872, 0, 1043, 0)
    assert set(sst.labels) == set(cola.labels) == {"0", "1"}


@pytest.mark.parametrize("task,text,message", [
    ("sst2", "text\tlabel\nfoo\t1\n", "header has no column 'sentence'"),
    ("sst2", "sentence\tlabel\nfoo\t2\n", "line 2: label '2' is not one of 0, 1"),
    ("sst2", "sentence\tlabel\nfoo\n", "line 2: 1 columns"),
    ("sst2", "", "is empty"),
    ("sst2", "sentence\tlabel\n", "is empty"),
    ("cola", "gj04\t1\tThe sailors.\n", "3 columns, cola files have 4"),
    ("rte", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n", "label 'maybe'"),
    ("stsb", SAMPLES["stsb"][0] + "\n" + SAMPLES["stsb"][1].replace("5.000", "high") + "\n",
     "score 'high' is not a number"),
    ("mrpc", "sentence\tlabel\nfoo\t1\n", "no column '#1 String'"),  # single sentences
])
def test_bad_tables_are_refused_in_one_line(tmp_path, task, text, message):
    path = tmp_path / "t.tsv"
    path.write_text(text)
    with pytest.raises(DynaseqError, match=message) as err:
        read_table(path, GLUE_TASKS[task])
    assert "\n" not in str(err.value)


def test_empty_sentences_are_counted_and_skipped(tmp_path):
    path = tmp_path / "t.tsv"
    path.write_text("index\tsentence1\tsentence2\tlabel\n0\ta\t\t1\n1\t \tb\t0\n2\tc\td\t1\n")
    ex = read_table(path, GLUE_TASKS["wnli"])
    assert (ex.text_a, ex.text_b, ex.labels, ex.skipped, ex.line_numbers) == (
        ["c"], ["d"], ["1"], 2, [4])
    # the empty sentence in the first column (SST-2) or the last (CoLA), CRLF line ends
    path.write_text("sentence\tlabel\r\na charming film\t1\r\n\t0\r\ndull\t0\r\n")
    ex = read_table(path, GLUE_TASKS["sst2"])
    assert (ex.text_a, ex.labels, ex.skipped) == (["a charming film", "dull"], ["1", "0"], 1)
    path.write_text("gj04\t1\t\ta good sentence .\ngj04\t0\t*\t\n"
                    "gj04\t0\t*\tbad sentence a .\t\r\n")  # a stray tab at the end: space
    ex = read_table(path, GLUE_TASKS["cola"])
    assert (ex.text_a, ex.labels, ex.skipped) == (["a good sentence .", "bad sentence a ."],
                                                  ["1", "0"], 1)


def test_pair_segments(mlm_run):
    vocab = EncoderVocab.load(mlm_run / "spm.model")
    ids, segs = vocab.encode_pair([10, 11], [12, 13, 14])
    assert ids == [4, 10, 11, 5, 12, 13, 14, 5] and segs == [0, 0, 0, 0, 1, 1, 1, 1]
    assert vocab.encode_pair([10, 11]) == ([4, 10, 11, 5], [0, 0, 0, 0])
    # too long: the longer sentence loses tokens from its end first
    ids, segs = vocab.encode_pair([10, 11, 12], [20, 21, 22, 23, 24], max_len=8)
    assert ids == [4, 10, 11, 12, 5, 20, 21, 5] and segs == [0] * 5 + [1] * 3
