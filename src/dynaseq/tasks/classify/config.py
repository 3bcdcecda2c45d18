"""A fine-tuning run's config (``task: classify`` at the top of the YAML): the encoder, the
labelled TSV files (a GLUE task by name, or a column spec), and training (optionally from a
pre-trained MLM run, ``train.init_from``).

Example::

    cfg = load_config("configs/sst2_small.yaml", ["train.init_from=runs/wikitext2_mlm_small"])
    cfg.data.glue_task, cfg.data.layout().labels       # "sst2", ("0", "1")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from dynaseq.core.config import check_positive, check_task
from dynaseq.core.errors import ConfigError
from dynaseq.metrics.classification import LABEL_METRICS, SCORE_METRICS
from dynaseq.tasks.classify.glue import GLUE_TASKS, TableLayout
from dynaseq.tasks.encoder.config import (
    EncoderModelConfig,
    EncoderSubwordSettings,
    EncoderTrainConfig,
)

#: The ``task:`` of a fine-tuning config.
TASK = "classify"


@dataclass
class ColumnSpec:
    """A TSV that is not a GLUE task: 0-based columns of the first sentence ``text_a``, the
    optional second ``text_b`` and the ``label``; ``header``: the first line names the
    columns (skipped). ``labels``: the label set (its order is the classifier's outputs;
    None: the sorted labels of the training file, saved with the run); ``regression``: the
    label is a number (one output, MSE). ``metrics``: what validation reports, the first is
    what ``best/`` keeps; ``positive``: F1's positive label (default the second label)."""

    text_a: int = 0
    text_b: int | None = None
    label: int = 1
    header: bool = False
    labels: list[str] | None = None
    regression: bool = False
    metrics: list[str] = field(default_factory=lambda: ["accuracy"])
    positive: str | None = None

    def __post_init__(self) -> None:
        cols = [self.text_a, self.label] + ([] if self.text_b is None else [self.text_b])
        if min(cols) < 0 or len(set(cols)) != len(cols):
            raise ConfigError(f"columns must be distinct and >= 0, got text_a={self.text_a}, "
                              f"text_b={self.text_b}, label={self.label}")
        known = SCORE_METRICS if self.regression else LABEL_METRICS
        if not self.metrics or any(m not in known for m in self.metrics):
            raise ConfigError(f"metrics must be among {', '.join(known)} for a "
                              f"{'regression' if self.regression else 'classification'}, "
                              f"got {self.metrics}")
        if self.regression and self.labels is not None:
            raise ConfigError("a regression has no labels")
        if self.labels is not None and (len(self.labels) < 2
                                        or len(set(self.labels)) != len(self.labels)):
            raise ConfigError(f"labels must list at least two distinct labels, got {self.labels}")


@dataclass
class ClassifyDataConfig(EncoderSubwordSettings):
    """Labelled TSV files (``train``, ``valid``, optionally ``test``) in the layout of
    ``glue_task`` (one of :data:`~dynaseq.tasks.classify.glue.GLUE_TASKS`, read as the GLUE
    download writes them) or of ``columns``. ``vocab_size``, ``spm_model_type`` and
    ``character_coverage`` (:class:`~dynaseq.tasks.encoder.config.EncoderSubwordSettings`):
    the SentencePiece model trained on the training sentences when not fine-tuning a
    pre-trained run (which brings its own). ``max_len``: tokens per input, [CLS]/[SEP]
    included (longer inputs are cut, the longer sentence first). ``batch_size``: sentences per
    micro-batch."""

    PATHS: ClassVar[tuple[str, ...]] = ("train", "valid", "test")  # files (not exported)

    glue_task: str | None = None
    columns: ColumnSpec | None = None
    train: str | None = None
    valid: str | None = None
    test: str | None = None
    max_len: int = 128
    batch_size: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "batch_size")
        if self.max_len < 4:
            raise ConfigError(f"max_len must be >= 4, got {self.max_len}")
        if (self.glue_task is None) == (self.columns is None):
            raise ConfigError("give exactly one of data.glue_task (one of "
                              f"{', '.join(GLUE_TASKS)}) and data.columns")
        if self.glue_task is not None and self.glue_task not in GLUE_TASKS:
            raise ConfigError(f"unknown GLUE task {self.glue_task!r}; known: "
                              f"{', '.join(GLUE_TASKS)}")

    def layout(self) -> TableLayout:
        """How the files are read and scored."""
        if self.glue_task is not None:
            return GLUE_TASKS[self.glue_task]
        c = self.columns
        labels = None if c.labels is None else tuple(c.labels)
        positive = c.positive if c.positive is not None else (labels[1] if labels else None)
        return TableLayout("columns", c.text_a, c.text_b, c.label, c.header, labels,
                           c.regression, tuple(c.metrics), positive)


@dataclass
class ClassifyTrainConfig(EncoderTrainConfig):
    """:class:`EncoderTrainConfig` with fine-tuning defaults (BERT sec. 4: lr of a few 1e-4
    for small models, short warm-up, linear-ish decay via cosine, no label smoothing).
    ``init_from``: a pre-trained ``mlm`` run directory whose encoder (embeddings, layers,
    control symbols) initialises this model; its vocabulary is used and its model section
    must match this one's dimensions. None: train from scratch."""

    lr: float = 3e-4
    warmup_steps: int = 100
    max_steps: int = 2000
    valid_every: int = 200
    save_every: int = 200
    keep_last: int = 2
    init_from: str | None = None


@dataclass
class ClassifyRunConfig:
    """A fine-tuning run: selected by ``task: classify`` at the top of the YAML."""

    task: str = TASK
    run_dir: str = "runs/classify"
    model: EncoderModelConfig = field(default_factory=EncoderModelConfig)
    data: ClassifyDataConfig = field(default_factory=lambda: ClassifyDataConfig(
        glue_task="sst2"))
    train: ClassifyTrainConfig = field(default_factory=ClassifyTrainConfig)

    def __post_init__(self) -> None:
        check_task(self, TASK, "a fine-tuning")
        self.model.check_input_length("data.max_len", self.data.max_len)
