"""Language modelling (MicroNet) as a :class:`~dynaseq.tasks.protocol.Task` for the loop.

Each update is one window of ``data.batch_size`` parallel streams x ``model.extended_context``
tokens (MicroNet's C_e); consecutive updates read consecutive windows, and the per-layer
state (keys/values of the last C-1 positions) is carried across them without gradient, so
window starts see real context. The carried state is saved with each checkpoint, so resume is
exact. Single process (no DDP).

Extension points (:class:`LMHooks`): ``loss`` computes the loss of a window (where token
distillation and a trained neural cache plug in), ``after_step`` runs after every optimizer
step (where a Hebbian softmax update plugs in), ``before_step`` before each forward pass
(where gradual pruning plugs in). :class:`LMTask` builds the hooks the config asks for
(:func:`dynaseq.tasks.lm.hooks.config_hooks`: ``model.cache`` with ``train: true``,
``model.hebbian``, ``train.distill``), checking them before the run directory is written.

Run directory: ``config.yaml``, ``vocab.txt``, ``log.jsonl``, ``checkpoints/step_*``,
``best/`` (lowest validation loss), optionally ``averaged/``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dynaseq.core.distributed import DistEnv
from dynaseq.core.errors import ConfigError
from dynaseq.core.files import user_path
from dynaseq.core.runlog import RunLog
from dynaseq.data.lm_corpus import VOCAB_FILE, StreamBatches, Vocab, read_lm_lines
from dynaseq.models.lm import LMOutput, LMState, TransformerLM
from dynaseq.nn.relative_attention import RelativeCache
from dynaseq.tasks.lm.config import LMRunConfig
from dynaseq.tasks.lm.model import build_lm
from dynaseq.tasks.lm.predictor import evaluate_stream
from dynaseq.tasks.protocol import LossTerms, Update


def lm_loss(model: TransformerLM, out: LMOutput, targets: Tensor, step: int) -> LossTerms:
    """The plain LM loss: -log p(target) under the adaptive softmax, summed over the window.

    Extension point: token-level distillation ((1-λ_t)·L_hard + λ_t·L_soft, MicroNet
    sec. 4.1) and a jointly trained neural cache (sec. 3.5) replace this function through
    :attr:`LMHooks.loss`; ``out.hidden`` (B, T, d) and ``targets`` (B, T) are what they need.
    """
    h = out.hidden
    logp = model.softmax(h.reshape(-1, h.size(-1)), targets.reshape(-1))
    nll = -logp.sum()
    return LossTerms(nll, float(nll.detach()), targets.numel())


#: ``after_step(model, out, targets)``: called after each optimizer step (Hebbian softmax).
AfterStep = Callable[[TransformerLM, LMOutput, Tensor], None]
#: ``before_step(model, step)``: called before the forward pass of each step (pruning).
BeforeStep = Callable[[TransformerLM, int], None]


@dataclass
class LMHooks:
    """Where distillation, the neural cache, the Hebbian softmax and pruning plug into
    training. ``loss(model, out, targets, step)``: ``step`` is the global update index; the
    window index in the epoch is ``step % len(train)`` (both advance together). A ``loss``
    that carries state from one window to the next gives it to the checkpoints through
    ``trainer_state() -> dict`` and ``load_trainer_state(state, device)`` methods (as
    :class:`~dynaseq.tasks.lm.hooks.ConfigLoss` does), so resume stays exact."""

    loss: Callable[[TransformerLM, LMOutput, Tensor, int], LossTerms] = lm_loss
    after_step: list[AfterStep] = field(default_factory=list)
    before_step: list[BeforeStep] = field(default_factory=list)


def _state_tensors(state: LMState | None) -> list[Tensor]:
    if state is None:
        return []
    return [t.cpu() for c in state.caches for t in (c.k, c.v)]


def _state_from(tensors: list[Tensor], device: torch.device) -> LMState | None:
    if not tensors:
        return None
    caches = [RelativeCache(tensors[i].to(device), tensors[i + 1].to(device))
              for i in range(0, len(tensors), 2)]
    return LMState(caches)


class LMTask:
    """See the module doc. ``cfg``: an :class:`LMRunConfig`; ``hooks`` replace the config's.

    Construction reads the corpus, builds the vocabulary, the model and the hooks (a bad
    cutoff or teacher directory raises here, before anything is written).
    """

    def __init__(self, cfg: LMRunConfig, hooks: LMHooks | None = None) -> None:
        if cfg.data.train is None:
            raise ConfigError("data.train is required for training")
        self.cfg = cfg
        self.run_dir = user_path(cfg.run_dir)
        train_lines = read_lm_lines(cfg.data.train, min_lines=2)
        vocab_path = self.run_dir / VOCAB_FILE
        self.vocab = Vocab.load(vocab_path) if vocab_path.is_file() else Vocab.build(train_lines)
        self.train = StreamBatches(self.vocab.encode_lines(train_lines), cfg.data.batch_size,
                                   cfg.model.extended_context)
        self.valid_ids = None
        if cfg.data.valid is not None:
            self.valid_ids = self.vocab.encode_lines(read_lm_lines(cfg.data.valid, min_lines=1))
        torch.manual_seed(cfg.train.seed)
        self.model = build_lm(cfg.model, len(self.vocab))
        from dynaseq.tasks.lm.hooks import config_hooks

        self.hooks = hooks or config_hooks(cfg, self.train, self.vocab)
        self.memory: LMState | None = None

    def prepare(self, env: DistEnv, device: torch.device, log: RunLog) -> None:
        if env.enabled:
            raise ConfigError("language-model training runs in one process (no DDP)")
        if not (self.run_dir / VOCAB_FILE).is_file():
            self.vocab.save(self.run_dir / VOCAB_FILE)
        log.write("data", split="train", tokens=self.train.n_tokens + self.cfg.data.batch_size,
                  vocab=len(self.vocab), windows=len(self.train))
        self.device = device
        self.model = self.model.to(device)

    def n_updates(self, epoch: int) -> int:
        return len(self.train)

    def update(self, epoch: int, pos: int, step: int, env: DistEnv) -> Update:
        if pos == 0:
            self.memory = None  # a new pass over the streams
        x, y = (t.to(self.device) for t in self.train[pos])
        for before in self.hooks.before_step:
            before(self.model, step)
        return Update([(x, y)], y.numel())

    def forward(self, model: TransformerLM, micro: tuple[Tensor, Tensor]) -> LMOutput:
        return model(micro[0], self.memory)

    def loss(self, out: LMOutput, micro: tuple[Tensor, Tensor], step: int) -> LossTerms:
        return self.hooks.loss(self.model, out, micro[1], step)

    def after_update(self, out: LMOutput, micro: tuple[Tensor, Tensor]) -> None:
        for after in self.hooks.after_step:
            after(self.model, out, micro[1])
        self.memory = out.state.detach()

    def validate(self, model: TransformerLM) -> dict[str, float]:
        """Validation loss and perplexity (``data.valid_max_tokens`` tokens at most)."""
        if self.valid_ids is None:
            return {}
        r = evaluate_stream(model, self.valid_ids, self.cfg.data.eval_batch_size,
                            self.cfg.model.extended_context, self.device,
                            self.cfg.data.valid_max_tokens)
        return {"loss": r["loss"], "ppl": r["ppl"]}

    def score(self, metrics: dict[str, float]) -> float | None:
        return -metrics["loss"] if "loss" in metrics else None

    def trainer_state(self) -> dict[str, Any]:
        """The carried per-layer state and, when the loss hook carries state of its own (a
        trained cache's memory, :class:`~dynaseq.tasks.lm.hooks.ConfigLoss`), that state."""
        state: dict[str, Any] = {"memory": _state_tensors(self.memory)}
        if hasattr(self.hooks.loss, "trainer_state"):
            state["loss_hook"] = self.hooks.loss.trainer_state()
        return state

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.memory = _state_from(state.get("memory", []), self.device)
        if hasattr(self.hooks.loss, "load_trainer_state"):
            self.hooks.loss.load_trainer_state(state.get("loss_hook", {}), self.device)
