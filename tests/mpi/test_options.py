"""Honest options: --help shows every default; an option that has no effect is refused on the
command line (naming both options) and a warning in a config file."""

from __future__ import annotations

import re

import pytest

import mpirun
from mpilb.cli.main import build_parser
from mpilb.config.build import build_config
from mpilb.config.options import NO_EFFECT, OPTION_BY_NAME, OPTIONS
from mpilb.errors import UsageError


def test_train_help_shows_every_default():
    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    flat = re.sub(r"\s+", " ", text)
    for opt in OPTIONS:
        if "default" in opt.help:
            continue
        shown = re.escape(opt.flag) if opt.type is bool else re.escape(opt.flag) + r" \S+"
        assert re.search(shown + r".*?\(default: ", flat), opt.flag
    assert "(default: 0.1)" in flat and "(default: async)" in flat and "(default: --progress)" in flat


@pytest.mark.parametrize("cli,both", [
    ({"model": "cnn", "hidden": "999"}, ("--hidden 999", "--model cnn")),
    ({"optimizer": "sgd", "momentum": "0.5"}, ("--momentum 0.5", "--optimizer sgd")),
    ({"momentum": "0.5"}, ("--momentum 0.5", "--optimizer sgd")),
    ({"staleness_bound": "2"}, ("--staleness-bound 2", "--mode async")),
    ({"correction": "inverse", "dc_lambda": "0.1"}, ("--dc-lambda 0.1", "--correction inverse")),
    ({"min_batch": "8"}, ("--min-batch 8", "--batch-policy fixed")),
    ({"mode": "async", "batch_policy": "proportional", "sit_out": "0"}, ("--sit-out 0", "--mode async")),
    ({"progress": False, "progress_interval": "2"}, ("--progress-interval 2.0", "--no-progress")),
])
def test_option_without_effect_is_an_error_naming_both(cli, both):
    with pytest.raises(UsageError) as err:
        build_config({}, cli)
    text = str(err.value)
    assert all(b in text for b in both) and "no effect" in text


def test_options_that_apply_are_accepted():
    build_config({}, {"model": "mlp", "hidden": "64"})
    build_config({}, {"optimizer": "momentum", "momentum": "0.5", "nesterov": True})
    build_config({}, {"mode": "ssp", "staleness_bound": "2"})
    build_config({}, {"batch_policy": "proportional", "min_batch": "8", "mode": "sync", "sit_out": "0"})
    assert {name for name, *_ in NO_EFFECT} <= set(OPTION_BY_NAME)


def test_config_file_option_without_effect_is_a_warning(tmp_path, capsys):
    cfg = build_config({"hidden": "64", "momentum": 0.5}, {"model": "softmax"}, source="run.toml")
    err = capsys.readouterr().err
    assert cfg.network.model == "softmax"
    assert "mpilb: warning: run.toml: hidden = \"64\" has no effect with --model softmax" in err
    assert "run.toml: momentum = 0.5 has no effect with --optimizer sgd" in err


def test_cli_error_is_one_line_exit_2(tmp_path):
    res = mpirun.run(0, "train", "--model", "cnn", "--hidden", "999", "--log", tmp_path / "r.h5", timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "--hidden 999 has no effect with --model cnn" in res.stderr
