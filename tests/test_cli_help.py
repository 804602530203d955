"""Every verb's --help says what it does and shows an example; every option says what it is.

The parser is walked, so a verb or a flag added later without help fails here.
"""

from __future__ import annotations

import argparse

import pytest

from supervisor.cli.verbs import build_parser, main


def _verbs() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


VERBS = _verbs()
#: The verbs that ask a running sidecar's control API.
OPERATOR_VERBS = [
    "incidents",
    "approvals",
    "breakers",
    "remediations",
    "runs",
    "commands",
    "reload",
]


@pytest.mark.parametrize("name", sorted(VERBS))
def test_every_verb_has_a_description_and_an_example(name: str) -> None:
    verb = VERBS[name]

    assert (verb.description or "").strip(), f"{name} has no description"
    epilog = verb.epilog or ""
    assert "examples:" in epilog, f"{name} shows no example"
    assert f"  spanvisor {name}" in epilog, f"{name}'s examples do not run it"
    # The epilog's line breaks are kept (examples are one a line).
    assert issubclass(verb.formatter_class, argparse.RawDescriptionHelpFormatter)


@pytest.mark.parametrize("name", sorted(VERBS))
def test_every_option_and_argument_says_what_it_is(name: str) -> None:
    verb = VERBS[name]

    missing = [
        "/".join(action.option_strings) or action.dest
        for action in verb._actions
        if action.help != argparse.SUPPRESS and not (action.help or "").strip()
    ]

    assert missing == [], f"{name}: no help for {missing}"


@pytest.mark.parametrize("name", OPERATOR_VERBS)
def test_operator_verbs_say_which_variables_name_the_sidecar_and_its_token(name: str) -> None:
    helps = {
        option: action.help or ""
        for action in VERBS[name]._actions
        for option in action.option_strings
    }

    for variable in ("SPANVISOR_API_URL", "SPANVISOR_API_PORT"):
        assert variable in helps["--api"]
    assert "SPANVISOR_API_TOKEN" in helps["--token"]
    assert "SPANVISOR_TOKEN_FILE" in helps["--token"]
    assert "SPANVISOR_CONFIG" in helps["--config"]
    assert "SPANVISOR_API_URL" in (VERBS[name].epilog or "")


def test_reload_offers_no_output_it_would_ignore(capsys: pytest.CaptureFixture[str]) -> None:
    options = {option for action in VERBS["reload"]._actions for option in action.option_strings}

    assert "--output" not in options
    with pytest.raises(SystemExit) as exited:
        main(["reload", "--output", "jsonl"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --output" in capsys.readouterr().err


def test_help_is_printed_for_every_verb(capsys: pytest.CaptureFixture[str]) -> None:
    for name in VERBS:
        with pytest.raises(SystemExit) as exited:
            main([name, "--help"])
        assert exited.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: spanvisor {name}")
        assert "examples:" in out
