"""CTranslate2 decoding on request, in a process of its own (``batch1_latency``'s
:class:`CT2Process`). It imports nothing of torch: with torch loaded in the same process,
CTranslate2 ran about 2x slower on the Intel Xeon of session 50 (the dense ``tiny`` model at
batch 1: 8.6 ms alone, 18.5 in a child process that had imported torch), and torch's
decoding slowed for good after CTranslate2 ran beside it.

    python benchmarks/_ct2_worker.py MODEL_DIR THREADS

Reads one JSON request a line from stdin and writes one JSON answer a line to stdout:
``["time", rows, beam, length, repeats]`` -> the median ms of ``repeats`` decodes of the
source ids ``rows`` into exactly ``length`` tokens, after one untimed;
``["translate", rows, length]`` -> the greedy token ids. CTranslate2 runs its oneDNN
backend (``CT2_USE_MKL=0``, its default on non-Intel CPUs): its default on Intel CPUs, MKL,
decoded ``tiny`` at batch 1 in 128.8 ms against 8.6 and ``small`` in 380.2 against 27.7 there.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

VOCAB = 8000  # batch1_latency's models' vocabulary


def vocabulary() -> list[str]:
    """The converted model's vocabulary: token ``i`` is ``vocabulary()[i]``."""
    return ["<blank>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(4, VOCAB)]


def decode(translator, tokens: list[list[str]], beam: int, length: int) -> list:
    out = translator.translate_batch(tokens, beam_size=beam, min_decoding_length=length,
                                     max_decoding_length=length)
    assert all(len(r.hypotheses[0]) == length for r in out), "fixed-length decoding"
    return out


def main() -> None:
    os.environ["CT2_USE_MKL"] = "0"  # read when ctranslate2 loads, which only main does
    import ctranslate2

    model_dir, threads = sys.argv[1], int(sys.argv[2])
    translator = ctranslate2.Translator(model_dir, device="cpu", compute_type="float32",
                                        inter_threads=1, intra_threads=threads)
    vocab = vocabulary()
    for line in sys.stdin:
        kind, rows, *rest = json.loads(line)
        tokens = [[vocab[i] for i in row] for row in rows]
        if kind == "time":
            beam, length, repeats = rest
            decode(translator, tokens, beam, length)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                decode(translator, tokens, beam, length)
                times.append((time.perf_counter() - start) * 1000)
            answer: object = statistics.median(times)
        else:
            (length,) = rest
            answer = [[vocab.index(t) for t in r.hypotheses[0]]
                      for r in decode(translator, tokens, 1, length)]
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
