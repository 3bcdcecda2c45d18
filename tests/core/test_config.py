from pathlib import Path

import pytest

from dynaseq.core.config import from_dict, read_yaml, save_config
from dynaseq.core.errors import ConfigError
from dynaseq.metrics import count_macs
from dynaseq.tasks.registry import load_config
from dynaseq.tasks.translation.config import MODEL_SIZES, ModelConfig, RunConfig
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.techniques.branching.config import DMBConfig, MoEConfig
from dynaseq.techniques.cct.config import CCTConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_configs_exist():
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_parses_and_builds(path):
    cfg = load_config(path)
    if getattr(cfg, "task", None) == "lm":  # language models: WikiText-2's 33,278 words
        from dynaseq.tasks.lm.model import build_lm

        assert len(build_lm(cfg.model, 33_278).layers) == cfg.model.n_layers
        return
    if getattr(cfg, "task", None) in ("mlm", "classify"):  # encoders
        from dynaseq.tasks.encoder.model import MLM, build_encoder_model

        head = MLM if cfg.task == "mlm" else cfg.data.layout().n_outputs
        model = build_encoder_model(cfg.model, cfg.data.vocab_size, head)
        assert model.encoder.depth == cfg.model.layers
        assert model.n_controls == (0 if cfg.model.cct is None else len(cfg.model.cct.controls))
        from dynaseq.data.datasets import resolve_data_path

        for path_field in ("train", "valid"):  # the shipped data paths exist (under the root)
            paths = getattr(cfg.data, path_field)
            for p in paths if isinstance(paths, list) else [paths]:
                assert resolve_data_path(p).is_file(), p
        return
    model = build_seq2seq(cfg.model, cfg.data.vocab_size)
    assert len(model.encoder.layers) == cfg.model.encoder_layers
    macs = count_macs(model, 2, 2)  # dense maximum: the FFN width is what the config says
    n_layers = cfg.model.encoder_layers
    per_token = 1 if cfg.model.moe is None else cfg.model.moe.k  # MoE: k experts per token
    assert macs.encoder["ffn.ffn_in"] == (n_layers * 2 * cfg.model.d_model * cfg.model.ffn_dim
                                          * per_token)
    assert model.n_controls == (0 if cfg.model.cct is None else len(cfg.model.cct.controls))


def test_named_sizes_fill_unset_fields_only():
    cfg = from_dict(ModelConfig, {"size": "small", "encoder_layers": 2, "n_heads": 8})
    assert (cfg.d_model, cfg.ffn_dim, cfg.n_heads, cfg.encoder_layers) == (256, 1024, 8, 2)
    assert MODEL_SIZES["tiny"]["d_model"] == 128 and MODEL_SIZES["base"]["ffn_dim"] == 2048
    big = from_dict(ModelConfig, {"size": "big"})
    assert (big.d_model, big.ffn_dim, big.n_heads) == (1024, 4096, 16)


def test_yaml_round_trip(tmp_path):
    cfg = load_config(None, ["model.size=tiny", "train.betas=[0.9, 0.99]", "train.max_minutes=2"])
    save_config(cfg, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert again == cfg and again.train.betas == (0.9, 0.99)


@pytest.mark.parametrize("override, message", [
    ("model.colour=3", "unknown config key model.colour"),
    ("nonsense=1", "unknown config key nonsense"),
    ("train.lr=fast", "train.lr: expected a number"),
    ("train.max_steps=1.5", "train.max_steps: expected an integer"),
    ("model.tie_output=3", "model.tie_output: expected true/false"),
    ("train.betas=[0.9]", "train.betas: expected 2 values"),
    ("model.size=huge", "unknown model size 'huge'"),
    ("data.long_lines=maybe", "long_lines must be 'skip' or 'truncate'"),
    ("model.dropout=1.5", "dropout must be in [0, 1)"),
    ("train", "is not of the form key=value"),
])
def test_bad_overrides_are_refused_with_the_key(override, message):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("config", ["multi30k_small.yaml", "wikitext2_mlm_small.yaml",
                                    "sst2_small.yaml"])
@pytest.mark.parametrize("override, message", [
    ("data.spm_model_type=words",
     "spm_model_type must be one of unigram, bpe, char, word; got 'words'"),
    ("data.character_coverage=0", "character_coverage must be in (0, 1], got 0.0"),
    ("data.character_coverage=1.5", "character_coverage must be in (0, 1], got 1.5"),
])
def test_every_task_checks_its_vocabulary_settings_when_the_config_is_read(config, override,
                                                                          message):
    """Translation, MLM and classification data sections share one set of SentencePiece
    settings: the same keys, defaults and checks, refused before anything is trained."""
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS[0].parent / config, [override])
    assert str(err.value) == f"data.{message}"


@pytest.mark.parametrize("config, reserved", [("multi30k_small.yaml", 4),
                                              ("wikitext2_mlm_small.yaml", 7),
                                              ("sst2_small.yaml", 7)])
def test_vocab_size_must_leave_room_after_the_special_ids(config, reserved):
    path = CONFIGS[0].parent / config
    assert load_config(path, [f"data.vocab_size={reserved + 1}"]).data.vocab_size == reserved + 1
    with pytest.raises(ConfigError, match=rf"^data\.vocab_size must be > {reserved} "
                                          rf"\(the special ids\), got {reserved}$"):
        load_config(path, [f"data.vocab_size={reserved}"])


def test_numbers_in_exponent_form_are_numbers(tmp_path):
    """YAML 1.2 reads ``3e-3`` as a number; PyYAML (1.1) read a string, refused as "expected
    a number" in a config file and in an override alike."""
    cfg = load_config(None, ["train.lr=3e-3", "train.adam_eps=1E-9", "train.clip_norm=+2e0"])
    assert (cfg.train.lr, cfg.train.adam_eps, cfg.train.clip_norm) == (3e-3, 1e-9, 2.0)
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 5e-4\n")
    assert load_config(path).train.lr == 5e-4
    with pytest.raises(ConfigError, match="expected an integer, got 1000.0"):
        load_config(None, ["train.warmup_steps=1e3"])  # a number, but not an integer
    assert read_yaml(path) == {"train": {"lr": 5e-4}}


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping at top level"):
        load_config(bad)
    bad.write_text("train:\n  lr: 0.1\n  warmup_steps: 5\n  lr: 0.2\n")  # PyYAML: the last
    with pytest.raises(ConfigError, match=r"not valid YAML: duplicate key 'lr' .* line 4"):
        load_config(bad)
    merged = tmp_path / "merged.yaml"  # a merge key is not a duplicate; its keys give way
    merged.write_text("base: &b {lr: 0.1, warmup_steps: 7}\n")
    assert read_yaml(merged)["base"]["lr"] == 0.1
    merged.write_text("b: &b {lr: 0.1, warmup_steps: 7}\nt: {<<: *b, lr: 0.2}\n")
    assert read_yaml(merged)["t"] == {"lr": 0.2, "warmup_steps": 7}
    bad.write_text("train:\n  lr: 0.1\nmodel:\n  lr: 0.1\n")  # the same key, two mappings
    with pytest.raises(ConfigError, match="unknown"):
        load_config(bad)


def test_defaults_are_valid():
    assert isinstance(from_dict(RunConfig, {}), RunConfig)


def test_cct_budget_grid_is_the_cross_product_with_one_symbol_per_distinct_pair():
    cct = CCTConfig(budget_grid=[1.0, 1.0, 0.5])
    assert cct.budgets == [(1.0, 1.0), (1.0, 1.0), (1.0, 0.5), (1.0, 1.0), (1.0, 1.0),
                           (1.0, 0.5), (0.5, 1.0), (0.5, 1.0), (0.5, 0.5)]
    assert cct.controls == [(1.0, 1.0), (1.0, 0.5), (0.5, 1.0), (0.5, 0.5)]
    assert cct.sampling_ids == [0, 0, 1, 0, 0, 1, 2, 2, 3]
    again = from_dict(CCTConfig, {"budgets": [list(b) for b in cct.budgets],
                                  "budget_grid": [1.0, 1.0, 0.5]})  # a saved config
    assert again.controls == cct.controls
    with pytest.raises(ConfigError, match="either budgets or budget_grid"):
        CCTConfig(budgets=[(0.5, 0.5)], budget_grid=[1.0, 0.5])
    with pytest.raises(ConfigError, match="budgets entries"):
        CCTConfig(budget_grid=[1.0, 1.5])


def test_cct_budget_curriculum_share():
    cct = CCTConfig(budgets=[(1.0, 1.0), (0.5, 0.5)], budget_start_step=100,
                    budget_ramp_steps=50)
    assert [cct.sampled_share(s) for s in (0, 99, 100, 125, 150, 10_000)] == [
        0.0, 0.0, 0.0, 0.5, 1.0, 1.0]
    assert CCTConfig(budgets=[(1.0, 1.0), (0.5, 0.5)]).sampled_share(0) == 1.0
    with pytest.raises(ConfigError, match="full budget"):
        CCTConfig(budgets=[(0.5, 0.5), (1.0, 1.0)], budget_ramp_steps=10)
    with pytest.raises(ConfigError, match=">= 0"):
        CCTConfig(budget_start_step=-1)


def test_dmb_and_moe_sections_round_trip_and_default_to_the_paper():
    cfg = load_config(None, ["model.dmb={}"])
    assert cfg.model.dmb == DMBConfig(n_branches=4, attention=True, shared_private=True,
                                      aux_weight=0.1, diversity=True, entropy=True)
    assert cfg.model.cct is None and cfg.model.moe is None
    cfg = load_config(None, ["model.moe.k=1", "model.moe.n_experts=8", "model.moe.attention=false"])
    assert cfg.model.moe == MoEConfig(n_experts=8, k=1, attention=False, aux_weight=0.1)
    assert ModelConfig().dmb is None and ModelConfig().moe is None


def test_dmb_and_moe_yaml_round_trip(tmp_path):
    for override in ("model.dmb.entropy=false", "model.moe.aux_weight=0.5"):
        cfg = load_config(None, [override, "model.dmb.n_branches=2"]
                          if "dmb" in override else [override])
        save_config(cfg, tmp_path / "c.yaml")
        assert load_config(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize("overrides, message", [
    (["model.dmb={}", "model.moe={}"], "model.dmb and moe cannot be combined"),
    (["model.cct={}", "model.dmb={}"], "model.cct and dmb cannot be combined"),
    (["model.cct={}", "model.moe={}"], "model.cct and moe cannot be combined"),
    (["model.dmb.n_branches=0"], "model.dmb.n_branches must be > 0"),
    (["model.dmb.aux_weight=-1"], "model.dmb.aux_weight must be >= 0"),
    (["model.dmb.diversity_weight=-0.5"], "model.dmb.diversity_weight must be >= 0"),
    (["model.dmb.attention=maybe"], "model.dmb.attention: expected true/false"),
    (["model.dmb.experts=4"], "unknown config key model.dmb.experts"),
    (["model.moe.k=4"], "model.moe.n_experts must exceed k"),
    (["model.moe.k=0"], "model.moe.k must be > 0"),
    (["model.moe.aux_weight=-0.1"], "model.moe.aux_weight must be >= 0"),
])
def test_bad_dmb_and_moe_configs_are_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_named_size_gives_that_size_from_python_too():
    from dynaseq.tasks.translation.config import MODEL_SIZES, ModelConfig
    from dynaseq.tasks.translation.model import build_seq2seq

    for size, dims in MODEL_SIZES.items():
        cfg = ModelConfig(size=size)
        assert (cfg.d_model, cfg.ffn_dim, cfg.n_heads) == tuple(dims.values())
    narrow = ModelConfig(size="small", ffn_dim=128)  # an explicit dimension wins
    assert (narrow.d_model, narrow.ffn_dim, narrow.n_heads) == (256, 128, 4)
    assert ModelConfig().d_model == 128  # no size: tiny's
    model = build_seq2seq(ModelConfig(size="small", encoder_layers=1, decoder_layers=1), 100)
    assert model.encoder.layers[0].ffn_norm.normalized_shape == (256,)


def test_a_sections_own_check_reads_after_the_sections_name():
    """A message that starts with one of the section's keys reads as its path; another
    follows the section's name (before: "model.unknown model size")."""
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS[0].parent / "multi30k_tiny.yaml", ["model.size=huge"])
    assert str(err.value).startswith("model: unknown model size 'huge'; known: ")
    with pytest.raises(ConfigError) as err:  # a check that names its own section: once
        load_config(CONFIGS[0].parent / "sst2_small.yaml", ["model.layerdrop=0.1",
                                                            "model.depth.gamma=0.5"])
    assert str(err.value).startswith("model.layerdrop is for dense encoders")
