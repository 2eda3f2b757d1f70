"""The commands and imports the README and docs/ show still work: every `pacerl ...` command in a code
block parses with the real command-line parser, the `key=value` overrides of a run's commands are keys
of the run config with values of the right type, every `from <project module> import names` in a
Python block imports, and every module, name and file of the project the pages cite exists. Synopsis
lines (`[optional]`, `a|b`, `...`) show a shape, not a command, and are left out; the test counts what
it checked, so a parser that stopped finding commands fails it."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from pacerl.cli import build_parser
from pacerl.config import RunConfig
from pacerl.settings import ConfigError, apply_overrides, settings_into

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROJECT = ("sandbox", "envs", "agents", "trainer", "pacerl")
RUN_COMMANDS = {"train", "sft", "eval"}
"""Commands whose `key=value` arguments are overrides of the run config."""
PLACEHOLDER_MODULES = ("your_module", "my_module", "my_tools")
"""The user's own modules the pages name (`module:NAME`): the keys around them are checked, their import
is the user's."""

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
_IMPORT = re.compile(r"^\s*from (\S+) import (\([^)]*\)|[^\n]+)", re.MULTILINE)


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block, in order."""
    blocks: list[tuple[str, str]] = []
    body: list[str] = []
    fence, info = "", ""
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence:
            closing = match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence)
            if closing and match and not match.group(2).strip():
                blocks.append((info, "\n".join(body)))
                fence = ""
                continue
            body.append(line)
        elif match:
            fence, info, body = match.group(1), match.group(2).strip(), []
    return blocks


def shown_commands() -> list[tuple[str, list[str]]]:
    """(page, argv after `pacerl`) of every command line in the pages' code blocks, continuation lines
    joined and comments dropped; synopsis lines left out."""
    found = []
    for page in PAGES:
        for _, body in code_blocks(page.read_text(encoding="utf-8")):
            for line in body.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ")
                if not line.startswith("pacerl "):
                    continue
                words = shlex.split(line, comments=True)[1:]
                if any(w.startswith("[") or w == "..." or ("|" in w and "=" not in w) for w in words):
                    continue
                found.append((page.name, words))
    return found


def shown_imports() -> list[tuple[str, str, list[str]]]:
    """(page, module, names) of every `from <project module> import ...` in the pages' Python blocks."""
    found = []
    for page in PAGES:
        for info, body in code_blocks(page.read_text(encoding="utf-8")):
            if info not in ("python", "py"):
                continue
            for match in _IMPORT.finditer(body):
                module = match.group(1)
                if module.split(".")[0] in PROJECT:
                    names = [n.split(" as ")[0].strip() for n in match.group(2).strip("()").split(",")]
                    found.append((page.name, module, [n for n in names if n]))
    return found


COMMANDS = shown_commands()
IMPORTS = shown_imports()


def test_the_pages_show_enough_commands_and_imports_to_check() -> None:
    assert len(COMMANDS) >= 35, [" ".join(words) for _, words in COMMANDS]
    assert len(IMPORTS) >= 10, IMPORTS
    assert {words[0] for _, words in COMMANDS} >= {"train", "eval", "sft", "simulate", "serve", "plot"}


def test_code_blocks_are_read_as_fenced() -> None:
    text = "prose `pacerl x`\n```bash\npacerl plot runs/x  # a\n~~~\n````\n~~~\nz\n~~~"
    assert code_blocks(text) == [("bash", "pacerl plot runs/x  # a\n~~~"), ("", "z")]


def test_the_rollouts_page_example_runs() -> None:
    """The quick start of docs/rollouts.md, run as written: a group of 8 episodes of the tiny model."""
    blocks = [
        body for info, body in code_blocks((ROOT / "docs" / "rollouts.md").read_text()) if info == "python"
    ]
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], "docs/rollouts.md", "exec"), namespace)
    group = namespace["group"]
    assert isinstance(group, list) and len(group) == 8
    assert all(trajectory.status.value in ("completed", "truncated", "failed") for trajectory in group)
    assert any(trajectory.num_model_tokens > 0 for trajectory in group)


@pytest.mark.parametrize(
    ("page", "words"), COMMANDS, ids=lambda v: v if isinstance(v, str) else " ".join(v)[:60]
)
def test_a_shown_command_parses_and_its_overrides_are_run_config_keys(page: str, words: list[str]) -> None:
    try:
        args = build_parser().parse_args(words)
    except SystemExit:
        pytest.fail(f"{page}: `pacerl {' '.join(words)}` does not parse")
    if words[0] in RUN_COMMANDS:
        overrides = list(args.overrides)
        try:
            settings_into(RunConfig(), apply_overrides({}, overrides))
        except ConfigError as error:
            if not any(f"cannot import module '{name}'" in str(error) for name in PLACEHOLDER_MODULES):
                pytest.fail(f"{page}: `pacerl {' '.join(words)}`: {error}")


@pytest.mark.parametrize(("page", "module", "names"), IMPORTS, ids=lambda v: v if isinstance(v, str) else "")
def test_a_shown_import_imports(page: str, module: str, names: list[str]) -> None:
    imported = importlib.import_module(module)
    missing = [name for name in names if not hasattr(imported, name)]
    assert not missing, f"{page}: `from {module} import ...` has no {missing}"


_DOTTED = re.compile(r"`((?:sandbox|envs|agents|trainer|pacerl)(?:\.\w+)*\.(?!py`|md`|toml`|json`)\w+)`")


def shown_names() -> list[tuple[str, str]]:
    """(page, dotted name) of every `package.module[.attribute]` the pages name in code spans."""
    return sorted(
        {
            (page.name, m.group(1))
            for page in PAGES
            for m in _DOTTED.finditer(page.read_text(encoding="utf-8"))
        }
    )


def resolves(dotted: str) -> bool:
    """Whether `dotted` names a module of the project, or an attribute (a class, function, constant,
    field) reached from the longest importable module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            fields = getattr(found, "__dataclass_fields__", {})
            if part in fields:  # a config field: its type is where the next part lives
                found = fields[part].type if cut < len(parts) - 1 else fields[part]
                continue
            if not hasattr(found, part):
                return False
            found = getattr(found, part)
        return True
    return False


def test_names_the_pages_cite_exist() -> None:
    names = shown_names()
    assert len(names) >= 20
    missing = [f"{page}: {name}" for page, name in names if not resolves(name)]
    assert not missing, missing
    assert not resolves("pacerl.agents.evaluation.no_such_module") and not resolves(
        "pacerl.cli.no_such_function"
    )


_PATH = re.compile(r"`((?:sandbox|envs|agents|trainer|pacerl|tests|benchmarks|configs|docs)/[\w./-]*\w)`")
_ENV_ID = re.compile(r"-v\d+$")
OTHER_PROJECTS = {"docs/en/algorithms/grpo_series.md"}
"""Paths the pages cite in other projects' repositories (AReaL's docs)."""


def test_files_the_pages_cite_exist() -> None:
    cited = {
        (page.name, m.group(1)) for page in PAGES for m in _PATH.finditer(page.read_text(encoding="utf-8"))
    }
    assert len(cited) >= 50
    files = {(page, path) for page, path in cited if not _ENV_ID.search(path) and path not in OTHER_PROJECTS}
    missing = sorted(f"{page}: {path}" for page, path in files if not (ROOT / path).exists())
    assert not missing, missing
