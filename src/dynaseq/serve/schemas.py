"""Request and response bodies (pydantic), so ``/docs`` shows the real schema.

Requests are strict: an unknown field, a string where a number belongs or a number where a
string belongs is a 422, never coerced. Each request gives ``text`` (one line) or ``texts``
(several); the answer mirrors it (``translation``/``translations``, ``text``/``texts``,
``score``/``scores``, ``label``/``labels``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Budget = float | tuple[float, float]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | None = Field(None, description="one input line")
    texts: list[str] | None = Field(None, min_length=1, description="several input lines")

    @model_validator(mode="after")
    def _one_of_text_texts(self) -> _Request:
        if (self.text is None) == (self.texts is None):
            raise ValueError('give "text" (one line) or "texts" (a list), not both or neither')
        return self

    @property
    def lines(self) -> list[str]:
        return [self.text] if self.text is not None else list(self.texts or [])


class _Deadlined(_Request):
    """A request that names its ``budget`` (typed by each subclass: a translation's may be a
    pair, a classifier's is one fraction) or its ``deadline_ms``, not both."""

    budget: Any = None  # each subclass declares its own type and description
    deadline_ms: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="answer within this many milliseconds: the server runs the "
                    "largest budget predicted to make it (from the run's latency table)")

    @model_validator(mode="after")
    def _budget_or_deadline(self) -> _Deadlined:
        if self.budget is not None and self.deadline_ms is not None:
            raise ValueError('give "budget" or "deadline_ms", not both')
        return self


class _Budgeted(_Deadlined):
    budget: float | list[float] | None = Field(
        None, description="compute budget: a fraction for encoder and decoder alike, or an "
                          "[encoder, decoder] pair; a trained or calibrated one")

    @field_validator("budget", mode="before")
    @classmethod
    def _budget_shape(cls, v: Any) -> Any:
        def number(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if v is None or number(v) or (isinstance(v, list) and len(v) == 2
                                      and all(number(x) for x in v)):
            return v
        raise ValueError("a budget is a fraction or an [encoder, decoder] pair of fractions")

    @property
    def budget_value(self) -> Budget | None:
        """``budget`` as :class:`Translator` takes it (a pair as a tuple)."""
        b = self.budget
        return (b[0], b[1]) if isinstance(b, list) else b


class TranslateRequest(_Budgeted):
    """``POST /v1/translate``."""


class GenerateRequest(_Budgeted):
    """``POST /v1/generate``: continue each prompt (``text``/``texts``; ``""`` starts a new
    line). A language model has no budget: ``budget`` and ``deadline_ms`` are refused."""

    tokens: int = Field(50, ge=0, description="words to generate")
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False, description="0 = greedy")
    top_k: int | None = Field(None, ge=1)
    seed: int = Field(0, ge=0, le=2**64 - 1)


class ScoreRequest(_Budgeted):
    """``POST /v1/score``: a language model's loss and perplexity of each line (its words and
    the end of line, from a line start)."""


class ClassifyRequest(_Deadlined):
    """``POST /v1/classify``: a label (or a regression score) per line. A sentence-pair task
    takes two tab-separated sentences per line (``"A man plays.\tA person plays."``), as
    :meth:`Classifier.classify` and ``dynaseq classify``; an empty line (or pair) gets
    ``null``."""

    budget: float | None = Field(
        None, description="encoder compute budget of a CCT classifier: a trained or "
                          "calibrated fraction in (0, 1]; a dense classifier takes none")
    gamma: float | None = Field(
        None, description="exit threshold of an adaptive-depth classifier, in (0, 1): 0.1 "
                          "slow and accurate ... 0.9 fast (default the run's depth.gamma)")


class Compute(BaseModel):
    """Realized compute of one line: MACs per token that ran (encoder per source token,
    decoder per target token) and their fraction of every gate on."""

    fraction: dict[str, float]
    macs_per_token: dict[str, float]


class _Response(BaseModel):
    budget: list[float] | None = Field(None, description="the [encoder, decoder] budget that "
                                                         "ran (None: the model has none)")
    degraded: bool = Field(False, description="the deadline policy chose a budget below the "
                                              "largest")
    latency_ms: float = Field(description="server-side time from arrival to answer")
    queue_ms: float = Field(description="time waiting for a batch")
    batch_lines: int = Field(description="lines in the batch this request ran in")


class TranslateResponse(_Response):
    translation: str | None = None
    translations: list[str] | None = None
    compute: Compute | list[Compute | None] | None = None


class GenerateResponse(_Response):
    text: str | None = None
    texts: list[str] | None = None
    compute: Compute | None = None


class ClassifyResponse(_Response):
    budget: float | None = Field(None, description="the encoder budget that ran (None: a "
                                                   "dense classifier)")
    label: str | float | None = Field(None, description="the line's label (a regression "
                                                        "task's score; null: an empty line)")
    labels: list[str | float | None] | None = None
    compute: Compute | list[Compute | None] | None = None
    gamma: float | None = Field(None, description="the exit threshold that ran (adaptive "
                                                  "depth; None: the model has none)")
    layers: int | list[int | None] | None = Field(
        None, description="adaptive depth: the layers each line ran (null: an empty line)")

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        """As pydantic's, but a one-line answer keeps ``label`` when it is null (an empty
        line) under ``exclude_none``."""
        data = super().model_dump(**kwargs)
        if self.labels is None:
            data.setdefault("label", None)
        return data


class LineScore(BaseModel):
    loss: float
    ppl: float
    tokens: int


class ScoreResponse(_Response):
    score: LineScore | None = None
    scores: list[LineScore] | None = None


class ErrorResponse(BaseModel):
    """Every refusal: ``{"error": "one line"}``. A 503 also says why, in ``reason`` (the
    label of ``dynaseq_rejected_total``): ``"deadline"`` (no budget meets the deadline on
    arrival), ``"late"`` (admitted, then dropped: predicted late when its batch formed, or
    its deadline passed while the batch decoded), ``"queue"`` (the queue is full),
    ``"busy"`` (``--max-in-flight`` requests already in flight), ``"draining"`` (the server
    is shutting down)."""

    error: str
    reason: Literal["deadline", "late", "queue", "busy", "draining"] | None = None


def one_line(errors: list[dict[str, Any]]) -> str:
    """A pydantic error list as one line: ``budget: Input should be a valid number; ...``."""
    parts = []
    seen = set()
    for e in errors:
        field = next((x for x in e.get("loc", ()) if x != "body"), "")
        if field in seen:  # one message per field (a union reports each alternative)
            continue
        seen.add(field)
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msg = str(e.get("msg", "invalid")).replace("Value error, ", "")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts[:3]).replace("\n", " ") + (
        f" (+{len(parts) - 3} more)" if len(parts) > 3 else "")
