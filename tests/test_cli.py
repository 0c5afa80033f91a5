"""moe_plugin.cli: ``train`` forwards its arguments to moe_plugin.train.main, a subcommand is one registered
function, help lists them, unknown subcommands are refused naming the valid ones, ``--version``."""

import re

import pytest

import moe_plugin
import moe_plugin.train
from moe_plugin import cli


def test_train_forwards_every_argument_after_its_name(monkeypatch):
    seen = []
    monkeypatch.setattr(moe_plugin.train, "main", seen.append)
    assert cli.main(["train", "--recipe", "r.json", "--local_rank=1"]) == 0
    assert seen == [["--recipe", "r.json", "--local_rank=1"]]


def test_train_help_is_the_trainers_own(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "usage: moe-plugin train" in out and "--recipe" in out


def test_a_new_subcommand_is_one_function(monkeypatch, capsys):
    monkeypatch.setattr(cli, "SUBCOMMANDS", dict(cli.SUBCOMMANDS))

    @cli.subcommand("layout", "show the parallel layout of a recipe")
    def layout(argv):
        return 3 if argv == ["--recipe", "r.json"] else 1

    assert cli.main(["layout", "--recipe", "r.json"]) == 3
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "train" in out and "layout" in out and "show the parallel layout" in out
    with pytest.raises(ValueError, match="subcommand: 'layout' is already registered"):
        cli.subcommand("layout", "again")


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"moe-plugin {moe_plugin.__version__}"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["bogus"], "invalid choice: 'bogus' \\(choose from 'train'"),
        ([], "the following arguments are required: <subcommand>"),
    ],
)
def test_no_or_unknown_subcommand(capsys, argv, match):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert re.search(match, capsys.readouterr().err)
