"""Configuration: defaults, TOML files, command-line overrides, validation messages."""

import pytest

from mpilb.config.build import build_config, load_toml, parse_hidden, settle_correction
from mpilb.core.corrections import GAP_DEFAULT_FLOATS
from mpilb.config.options import OPTIONS
from mpilb.errors import UsageError


def test_defaults_match_design():
    cfg = build_config()
    assert cfg.updates.mode == "async" and cfg.balancing.balancer == "load" and cfg.balancing.batch_policy == "fixed"
    assert cfg.inputs.store == "shared" and cfg.updates.correction == "dynamic" and cfg.updates.dc_lambda == 0.04
    assert cfg.inputs.replicas == 1 and cfg.updates.pipeline == 1 and cfg.experiment.inject == []


@pytest.mark.parametrize("values,pipeline", [
    ({}, 1), ({"correction": "dc"}, 1),          # async computes ahead by default
    ({"mode": "ssp"}, 0), ({"mode": "sync"}, 0),  # ssp keeps its bound exact; sync cannot
    ({"correction": "inverse"}, 0),               # it would divide the lr by twice the staleness
    ({"pipeline": "0"}, 0), ({"mode": "ssp", "pipeline": "1"}, 1),   # as given
    ({"correction": "inverse", "pipeline": "1"}, 1),
    # a momentum recipe under a momentum policy (dynamic, the default, or momentum): twice
    # the staleness costs more samples than computing ahead gains
    ({"optimizer": "momentum"}, 0), ({"optimizer": "momentum", "correction": "momentum"}, 0),
    ({"optimizer": "momentum", "correction": "none"}, 1),
    ({"optimizer": "momentum", "pipeline": "1"}, 1),
])
def test_the_pipeline_default_follows_the_mode(values, pipeline):
    assert build_config({}, values).updates.pipeline == pipeline
    assert build_config(values, {}, source="run.toml").updates.pipeline == pipeline   # from a file too


@pytest.mark.parametrize("mode,correction", [("async", "dynamic"), ("ssp", "dynamic"),
                                             ("sync", "none")])
def test_the_correction_default_follows_the_mode(mode, correction):
    assert build_config({}, {"mode": mode}).updates.correction == correction
    if mode == "sync":   # a sync round has nothing stale to correct: refused, not ignored
        with pytest.raises(UsageError, match="--correction dc has no effect with --mode sync"):
            build_config({}, {"mode": mode, "correction": "dc"})
    else:
        assert build_config({}, {"mode": mode, "correction": "dc"}).updates.correction == "dc"


@pytest.mark.parametrize("values,correction", [
    ({"optimizer": "momentum"}, "dana"), ({"optimizer": "momentum", "mode": "ssp"}, "dana"),
    ({"optimizer": "momentum", "weight_prediction": "on"}, "dana"),
    # without prediction dynamic, as before it
    ({"optimizer": "momentum", "weight_prediction": "off"}, "dynamic"),
    ({"optimizer": "sgd"}, "dynamic"), ({"optimizer": "sgd", "weight_prediction": "on"}, "dynamic"),
    ({"optimizer": "momentum", "mode": "sync"}, "none"),
    ({"optimizer": "momentum", "correction": "dynamic"}, "dynamic"),   # as given
    ({"optimizer": "momentum", "correction": "gap"}, "gap"),
])
def test_a_momentum_recipe_defaults_to_a_momentum_per_worker(values, correction):
    cfg = build_config({}, values)
    assert cfg.updates.correction == correction
    if values.get("mode") != "sync":
        assert cfg.updates.pipeline == 0 or values["optimizer"] == "sgd"


@pytest.mark.parametrize("values,floats,workers,correction", [
    ({"optimizer": "momentum"}, 200_000, 8, "dana"),                  # its velocities fit
    ({"optimizer": "momentum"}, 4810, 4, "dana"),
    ({"optimizer": "momentum"}, 20_000_000, 16, "lookahead"),         # 1.3 GB: they do not
    ({"optimizer": "momentum", "mode": "ssp"}, GAP_DEFAULT_FLOATS, 5000, "gap"),   # small: gap
    ({"optimizer": "momentum", "wire": "bf16"}, 4810, 100_000, "lookahead"),   # gap reads exact floats
    ({"optimizer": "momentum", "correction": "dana"}, 20_000_000, 16, "dana"),   # as given
    ({"optimizer": "momentum", "correction": "lookahead"}, 4810, 4, "lookahead"),
    ({"optimizer": "momentum", "weight_prediction": "off"}, 4810, 4, "dynamic"),
    ({"optimizer": "momentum", "mode": "sync"}, 4810, 4, "none"),
])
def test_the_default_is_settled_by_the_model_and_the_workers(values, floats, workers, correction):
    cfg = build_config({}, values)
    settled = settle_correction(cfg, floats, workers)
    assert settled.updates.correction == correction
    assert settled.updates.pipeline == cfg.updates.pipeline   # (0 for every policy)
    assert settled.given == cfg.given and settled.updates.wire == cfg.updates.wire
    assert settled.updates.weight_prediction == cfg.updates.weight_prediction


def test_dana_needs_the_momentum_optimizer():
    with pytest.raises(UsageError, match="--correction dana .* needs --optimizer momentum, not adam"):
        build_config({}, {"optimizer": "adam", "correction": "dana"})


def test_toml_with_dashes_or_underscores_and_cli_override(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('model = "softmax"\nstaleness-bound = 3\nbatch_policy = "proportional"\n'
                 'inject = ["3:compute=4"]\nhidden = [64, 32]\n')
    cfg = build_config(load_toml(str(f)), {"model": "cnn", "lr": "0.5"}, source=str(f))
    assert cfg.network.model == "cnn" and cfg.updates.staleness_bound == 3 and cfg.optim.lr == 0.5
    assert cfg.balancing.batch_policy == "proportional" and cfg.experiment.inject == ["3:compute=4"]
    assert cfg.hidden_sizes == (64, 32)


def test_unknown_key_names_closest(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("staleness_bund = 3\n")
    with pytest.raises(UsageError, match="staleness_bund.*did you mean 'staleness_bound'"):
        load_toml(str(f))


def test_unknown_key_without_a_close_one_lists_the_valid_keys(tmp_path):
    f = tmp_path / "c1.toml"
    f.write_text("bogus_key = 3\n")
    with pytest.raises(UsageError) as err:
        load_toml(str(f))
    text = str(err.value)
    assert text.startswith(f"{f}: unknown key 'bogus_key'; valid keys: balancer, batch, ")
    assert all(o.name in text for o in OPTIONS) and "model_args" in text


def test_target_accuracy_on_regression_data_is_refused_or_warned(tmp_path, capsys):
    """--target-accuracy does nothing on float targets: refused on the command line
    (pointing to --target-metric), a warning from a config file, like NO_EFFECT."""
    from types import SimpleNamespace

    from mpilb.config.validate import check_world

    regression = SimpleNamespace(num_classes=0, root="reg", sample_shape=(5,))
    with pytest.raises(UsageError, match=r"--target-accuracy 0\.9 has no effect with regression "
                       r"data \(reg holds float targets.*use --target-metric"):
        check_world(build_config({}, {"target_accuracy": "0.9"}), 2, regression)
    f = tmp_path / "c.toml"
    f.write_text("target_accuracy = 0.9\n")
    check_world(build_config(load_toml(str(f)), {}, source=str(f)), 2, regression)
    assert "c.toml: target_accuracy = 0.9 has no effect with regression data" in capsys.readouterr().err
    check_world(build_config({}, {"target_metric": "0.9"}), 2, regression)   # the right one
    classes = SimpleNamespace(num_classes=10, root="d", sample_shape=(64,))
    check_world(build_config({}, {"target_accuracy": "0.9"}), 2, classes)
    assert capsys.readouterr().err == ""


def test_unknown_cli_option_names_closest():
    with pytest.raises(UsageError, match="did you mean 'balancer'"):
        build_config({}, {"balancr": "load"})


@pytest.mark.parametrize("key,value,message", [
    ("lr", "-0.1", "--lr.*must be a number > 0"),
    ("lr", "abc", "--lr.*expected a number"),
    ("batch", "0", "--batch.*must be an integer >= 1"),
    ("batch", "2.5", "--batch.*expected an integer"),
    ("mode", "fast", "--mode.*allowed values are async, ssp, sync"),
    ("balancer", "lod", "did you mean 'load'"),
    ("hidden", "64,0", "--hidden.*positive layer sizes"),
    ("hidden", "a,b", "--hidden.*positive layer sizes"),
    ("target_accuracy", "1.5", "--target-accuracy.*\\(0, 1\\]"),
    ("momentum", "1.0", "--momentum.*\\[0, 1\\)"),
    ("pipeline", "2", "--pipeline.*allowed values are 0, 1"),
])
def test_bad_values_name_the_option(key, value, message):
    with pytest.raises(UsageError, match=message):
        build_config({}, {key: value})


def test_bad_value_in_file_names_file_and_key(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("batch = -3\n")
    with pytest.raises(UsageError, match=r"c\.toml: batch = -3: must be"):
        build_config(load_toml(str(f)), {}, source=str(f))


@pytest.mark.parametrize("values,message", [
    ({"min_batch": "64", "max_batch": "32"}, "--min-batch 64 is larger than --max-batch 32"),
    ({"resume": True}, "--resume needs --log RUN.h5"),
    ({"resume": True, "log": "r.h5", "overwrite": True}, "--resume continues"),
    ({"replicas": "2"}, "--replicas 2 has no effect with --store shared"),
    ({"pipeline": "1", "mode": "sync"}, "--pipeline 1 cannot be combined with --mode sync"),
    ({"correction": "dana", "optimizer": "momentum", "mode": "sync"},
     "--correction dana has no effect with --mode sync"),
])
def test_bad_combinations(values, message):
    with pytest.raises(UsageError, match=message):
        build_config({}, values)


def test_toml_errors(tmp_path):
    with pytest.raises(UsageError, match="config file not found"):
        load_toml(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("model = \n")
    with pytest.raises(UsageError, match="bad.toml: not valid TOML"):
        load_toml(str(bad))


def test_parse_hidden():
    assert parse_hidden("256,128") == (256, 128)
    assert parse_hidden([8]) == (8,)
    with pytest.raises(UsageError):
        parse_hidden("")


def test_every_option_has_help_and_a_valid_default():
    for opt in OPTIONS:
        assert opt.help
        if opt.choices is not None and opt.default_text is None:
            assert opt.default in opt.choices
        if opt.default_text is not None:   # decided by build_config (or at run time)
            assert opt.default is None
            value = build_config().values[opt.name]
            if opt.choices is not None:    # from other options: one of its choices
                assert value in opt.choices
            elif value is not None:
                assert opt.check[0](value)


def test_adamw_decays_by_default_as_torch_and_torch_classes_keep_their_own_default():
    assert build_config({}, {"optimizer": "adamw"}).optim.weight_decay == 0.01
    assert build_config({}, {"optimizer": "adam"}).optim.weight_decay == 0.0
    assert build_config({}, {"optimizer": "adamw", "weight_decay": 0.0}).optim.weight_decay == 0.0
    assert build_config({}, {"optimizer": "torch.optim.AdamW"}).optim.weight_decay is None
    with pytest.raises(UsageError, match="--optimizer = 'rmsprop'.*torch.optim.NAME"):
        build_config({}, {"optimizer": "rmsprop"})


def test_configuration_reference_is_current():
    from pathlib import Path

    from mpilb.config.build import reference_markdown

    page = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert page.read_text() == reference_markdown(), \
        "docs/configuration.md is stale: python -m mpilb.config.build > docs/configuration.md"


# ---------------------------------------------------------------- typed sections (sections.py)


def test_every_option_is_a_field_of_exactly_one_typed_section():
    from dataclasses import fields

    from mpilb.config.sections import SECTIONS

    placed = [f.name for kind in SECTIONS.values() for f in fields(kind)]
    assert sorted(placed) == sorted(o.name for o in OPTIONS)   # each once
    assert not set(SECTIONS) & {o.name for o in OPTIONS}        # no section hides an option


def test_sections_hold_the_values_and_the_flat_values_mirror_them():
    from dataclasses import FrozenInstanceError

    from mpilb.config.sections import (SECTION_OF, BalancingConfig, Config, OptimizerConfig,
                                       OutputConfig)

    cfg = build_config({}, {"lr": "0.5", "batch": "64", "log": "r.h5", "optimizer": "adamw"})
    assert isinstance(cfg.optim, OptimizerConfig) and cfg.optim.lr == 0.5
    assert isinstance(cfg.balancing, BalancingConfig) and cfg.balancing.batch == 64
    assert isinstance(cfg.output, OutputConfig) and cfg.output.log == "r.h5"
    assert cfg.optim.weight_decay == 0.01   # the defaults build_config decides are in them
    for name, section in SECTION_OF.items():
        assert getattr(getattr(cfg, section), name) == cfg.values[name]
        assert not hasattr(cfg, name), name   # an option is read from its section only
    with pytest.raises(FrozenInstanceError):
        cfg.optim.lr = 1.0                  # and so are the sections
    with pytest.raises(TypeError):
        cfg.values["lr"] = 1.0              # the flat values are a read-only view
    again = Config.from_values(dict(cfg.values))   # what the other ranks rebuild
    assert again == cfg and again.to_json() == cfg.to_json()
    cfg.set_files(checkpoint="r.ckpt.h5")   # the one change after validation
    assert cfg.output.checkpoint == cfg.output.checkpoint == "r.ckpt.h5" and cfg.output.log == "r.h5"


def test_validation_lives_in_config_validate_and_reference_reads_the_table_only():
    """The checks once spread over build.py, run/training.py, server/store.py and
    cli/launch.py are in mpilb.config.validate; config.build and config.reference no
    longer import each other in a circle."""
    import ast
    from pathlib import Path

    import mpilb.config.validate as validate

    for name in ("check_value", "check_combinations", "check_no_effect", "no_effect",
                 "same_options", "check_injects", "check_world", "check_optimizer",
                 "check_model_step", "check_servers"):
        assert callable(getattr(validate, name)), name
    root = Path(validate.__file__).resolve().parents[1]

    def defined(path):
        tree = ast.parse((root / path).read_text())
        return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}

    def imported(path):
        tree = ast.parse((root / path).read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}

    assert not (root / "run" / "training.py").exists()   # split by concern, checks here
    assert "check_servers" not in defined("server/store.py")
    assert "_same_options" not in defined("cli/launch.py")
    assert "mpilb.config.build" not in imported("config/reference.py")
    assert "mpilb.config.build" not in imported("config/validate.py")
    assert "mpilb.config.build" not in imported("config/sections.py")


def test_a_non_finite_gradient_names_the_options_that_set_the_step():
    """A diverged run's error says what to try: a weight decay of 1e20 answered `lower --lr?`."""
    plain = build_config({}, {"lr": 1e30}).optim.divergence_hint()
    assert plain == "try a lower --lr (now 1e+30) or --clip-norm"
    decayed = build_config({}, {"lr": 0.05, "weight_decay": 1e20, "clip_norm": 1.0}).optim
    assert decayed.divergence_hint() == "try a lower --lr (now 0.05) or --weight-decay (now 1e+20)"
    both = build_config({}, {"weight_decay": 0.1}).optim.divergence_hint()
    assert both.startswith("try a lower --lr") and both.endswith(", --weight-decay (now 0.1) or --clip-norm")


def test_gap_refuses_a_rounded_wire():
    # the worker read the parameters rounded: the gap would measure the rounding
    with pytest.raises(UsageError, match="--correction gap with --wire bf16"):
        build_config({}, {"optimizer": "momentum", "correction": "gap", "wire": "bf16"})
    assert build_config({}, {"optimizer": "momentum", "correction": "gap"}).updates.wire == "fp32"
