"""tests/README.md's table names, for every config key and CLI option, the test that runs it with a
non-default value: keep it true (a new key or option needs a row; a removed one loses its row)."""

import dataclasses
import os
import re
import typing

import click

from trainrun import config as C

HERE = os.path.dirname(os.path.abspath(__file__))


def table_rows():
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    return text, [m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", text, re.M)]


def config_keys(cls=C.Config, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        arms = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
        section = arms[0] if typing.get_origin(hints[f.name]) is typing.Union and len(arms) == 1 \
            and dataclasses.is_dataclass(arms[0]) else hints[f.name]
        if dataclasses.is_dataclass(section):      # a section, or one that may be null (model.lora)
            yield from config_keys(section, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def cli_options():
    from trainrun.data_tools.cli import main
    from trainrun.cli import cli

    def walk(cmd, name):
        for p in cmd.params:
            yield f"{name} {p.opts[0] if isinstance(p, click.Option) else p.name.upper()}"
        for sub_name, sub in getattr(cmd, "commands", {}).items():
            if not sub.hidden:
                yield from walk(sub, f"{name} {sub_name}")
    return [*walk(cli, "trainrun"), *walk(main, "trainrun-data")]


def test_every_config_key_and_cli_option_has_a_row():
    _, rows = table_rows()
    wanted = [*config_keys(), *cli_options()]
    assert len(wanted) > 100
    assert sorted(set(wanted) - set(rows)) == [], "add a row to tests/README.md"
    assert sorted(set(rows) - set(wanted)) == [], "tests/README.md has rows for keys or options that are gone"
    assert len(rows) == len(set(rows)), "a row appears twice"


def test_the_tests_named_exist():
    text, _ = table_rows()
    for file, name in set(re.findall(r"(test_\w+\.py)::(test_\w+)", text)):
        path = os.path.join(HERE, file)
        if os.path.exists(path):          # a file another branch adds is checked once it is here
            with open(path, encoding="utf-8") as fh:
                assert f"def {name}(" in fh.read(), f"{file}::{name} named in tests/README.md does not exist"
