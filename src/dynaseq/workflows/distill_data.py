"""Sequence-level knowledge distillation data (Kim & Rush 2016).

The DMB paper trains its students on "data generated with sequence-level knowledge
distillation" (Tan et al. 2021, section IV-E, Table IV): the teacher translates every
training source sentence with beam search, and the student is trained on (source, teacher
output) pairs instead of the references.

:func:`distill_lines` returns the teacher's beam-search output for every line (detokenized,
aligned: an empty input line gives an empty output line); :func:`write_distill_data` writes
them to a file atomically. From the command line::

    dynaseq distill-data runs/teacher --src train.en.gz --out train.kd.de.gz --beam 4

then train the student with a normal config whose ``data.train_tgt`` is that file (plain
text or gzip both read): ``dynaseq train student.yaml data.train_tgt=train.kd.de.gz``.
Sentences are sorted by length and decoded in batches with the batched beam search, so the
29k Multi30k training sentences take minutes with a tiny teacher on a CPU.
"""

from __future__ import annotations

import gzip
from pathlib import Path

from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import atomic_write, user_path
from dynaseq.core.progress import progress_bar
from dynaseq.data import write_lines
from dynaseq.tasks.translation.predictor import (
    Budget,
    Translator,
    decode_corpus,
    decode_settings,
)


def distill_lines(teacher: Translator, lines: list[str], beam: int = 4,
                  batch_size: int | None = None, budget: Budget = None,
                  progress: bool = False) -> list[str]:
    """The teacher's translation of each line, in input order (``""`` for an empty line).

    ``beam``: beam size (1 = greedy); ``batch_size``: sentences per batch (default the run's
    ``decode.batch_size``); ``budget``: a trained (or calibrated) budget of a CCT teacher.
    Length penalty and output-length limits come from the teacher's ``decode`` config.
    ``progress`` shows a tqdm bar over sentences.
    """
    settings = decode_settings(teacher.config.decode, beam, None, batch_size, None, None)
    batch = settings["batch_size"]
    keep, ids = teacher.tokenizer.encode_kept(lines)
    order = sorted(range(len(ids)), key=lambda j: len(ids[j]))  # similar lengths batch well
    hyps: list[list[int]] = [[] for _ in ids]
    with teacher.at_budget(budget) as control:  # refuses an unknown budget first
        # a bar on a terminal only, as every command's (tqdm wrote one into a redirected file)
        with progress_bar(len(ids), "sent", "distill", progress) as bar:
            for start in range(0, len(order), batch):
                chunk = order[start: start + batch]
                out = decode_corpus(teacher.model, [ids[j] for j in chunk], **settings,
                                    device=teacher.device, control=control,
                                    lean=teacher.lean_decoder())
                for j, h in zip(chunk, out, strict=True):
                    hyps[j] = h
                bar.update(len(chunk))
    result = [""] * len(lines)
    for i, text in zip(keep, teacher.tokenizer.decode(hyps), strict=True):
        result[i] = text.replace("\n", " ").strip()
    return result


def write_distill_data(teacher: Translator, src_path: str | Path, out_path: str | Path,
                       beam: int = 4, batch_size: int | None = None, budget: Budget = None,
                       progress: bool = False) -> int:
    """Translate every line of ``src_path`` into ``out_path``; returns the line count.

    ``out_path`` ending in ``.gz`` is written gzip-compressed, anything else as plain text.
    The file is written under a temporary name in the same folder and renamed at the end,
    so an interrupted run leaves no partial output.
    """
    from dynaseq.data import read_lines

    src = read_lines(src_path)
    out = user_path(out_path)
    hyps = distill_lines(teacher, src, beam, batch_size, budget, progress)
    if out.suffix != ".gz":
        write_lines(out, hyps)  # atomic, and /dev/null stays a device
        return len(hyps)
    payload = gzip.compress("".join(h + "\n" for h in hyps).encode("utf-8"), mtime=0)
    try:
        atomic_write(out, payload)
    except OSError as e:
        raise DynaseqError(f"cannot write {out}: {e.strerror or e}") from None
    return len(hyps)
