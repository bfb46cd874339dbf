"""The commands the docs show, run or dry-run, so that the docs cannot drift from the code.

Commands are read from README.md and docs/*.md: fenced shell blocks (continuation lines joined,
`&&` chains split, comments dropped) and inline code spans that start with `fedprivacy` or
`python`. Every failure names the doc file, its line and the command. What is done with them:

- `fedprivacy …`: every subcommand named anywhere (`fedprivacy plan`, `fedprivacy ledger
  accept-data`, …) must answer `--help`. The `plan` and `sheets` examples (a command with
  arguments, fenced or inline) run for real, in process, writing into a temporary folder (`--out`
  is redirected there, and `../shared/data` and `$PWD/../shared/data` become the shared data
  folder beside the repository; they are skipped, saying so, where it is absent), and the plan
  README's tour quotes is checked against the figures it states. `fedprivacy calculator` is only
  asked for `--help`: its 30 calibrated plans take 13–25 s on a 2-core machine. `report` and
  `ledger` examples name
  folders and ledgers that only a real run makes (placeholders such as LEDGER), so they get
  `--help` only, as does any command whose arguments are placeholders.
- `fedprivacy sweep …`: each command the docs show runs with `--dry-run` (its `--out` in a
  temporary folder), and so does every scenario file in scenarios/ and the scenario example in
  docs/simulator.md. Every scenario the docs name must exist, and the cell counts the docs state
  (`CELL_CLAIMS`) must be what the dry-runs count. The scenarios are dry-run from a copy of
  scenarios/ placed so that their relative paths find the PUMS extract, and the tuning scenarios'
  validation file (`runs/pums-validation.csv`, which `python -m sims.validation` writes from the
  extract) is stood in for by the extract itself: a dry-run only validates the cells and counts
  the clients, which the two files share.
- `python benchmarks/….py`, `python experiments/….py` and `python -m sims.…`: `--help` only, in
  process (they train, sweep or time for minutes; `python -m sims.validation` writes a file and
  takes 5–10 s).
- Relative links in the docs, SECURITY.md and CHANGELOG.md must point at files that exist, and
  their anchors at headings.

Not run at all: `flwr`, `flower-superlink`, `flower-supernode`, `pip`, `python -m pytest`,
`python3 -m venv`, `python -c …`, shell set-up (`export`, `mkdir`, `openssl`, …) and `python -m
fedprivacy.runconfig_docs docs/flower.md`, which rewrites docs/flower.md (tests/test_runconfig_keys.py
checks the table it writes). The file's tests take about 7 s on a shared 2-core machine (13 s
with pytest's start-up).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedprivacy.cli import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHARED_DATA = ROOT.parent / "shared" / "data"
PUMS = SHARED_DATA / "pums" / "fulton_pums5_full.csv"
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
RUN_FOR_REAL = {"plan", "sheets"}  # quick enough to run as the docs show them
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z_]*|.*[<>…\[\]].*)$")  # LEDGER, E, <run-id>, [--out, …
WIDE = {"COLUMNS": "240"}  # rich's tables and titles on one line each


@dataclass
class Command:
    """One command as the docs show it, and every place that shows it."""

    tokens: tuple[str, ...]
    places: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return shlex.join(self.tokens)

    def where(self) -> str:
        return f"{', '.join(self.places)}: {self.text}"


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _fences(text: str) -> list[tuple[int, str, str]]:
    """(first line number of the body, language, body) of every fenced block."""
    return [
        (text[: m.start(2)].count("\n") + 1, m.group(1).strip(), m.group(2))
        for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", text, re.S | re.M)
    ]


def _split(line: str) -> list[list[str]]:
    """A shell line as commands: comments dropped, `&&` and `;` chains split, `time` prefixes removed."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote: prose in a code span, not a command
        return []
    commands, current = [], []
    for token in [*tokens, "&&"]:
        if token in ("&&", ";", "||"):
            if current:
                while current and current[0] in ("time", "/usr/bin/time", "-v", "nice", "-n", "10"):
                    current = current[1:]
                commands.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in commands if c]


def _doc_commands() -> list[Command]:
    """Every `fedprivacy` and `python` command the docs show, each once, with where it is shown."""
    found: dict[tuple[str, ...], Command] = {}

    def add(tokens: list[str], place: str) -> None:
        if tokens[0] in ("fedprivacy", "python", "python3"):
            found.setdefault(tuple(tokens), Command(tuple(tokens))).places.append(place)

    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for first, language, body in _fences(text):
            if language not in SHELL_LANGUAGES:
                continue
            joined, start = "", first
            for offset, line in enumerate(body.splitlines()):
                if not joined:
                    start = first + offset
                if line.rstrip().endswith("\\"):
                    joined += line.rstrip()[:-1] + " "
                    continue
                for tokens in _split(joined + line):
                    add(tokens, f"{_relative(doc)}:{start}")
                joined = ""
        prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
        for match in re.finditer(r"`([^`\n]+(?:\n[^`\n]+)*)`", prose):
            span = " ".join(match.group(1).split())
            if span.startswith(("fedprivacy ", "python ", "python3 ")) or span == "fedprivacy":
                for tokens in _split(span):
                    add(tokens, f"{_relative(doc)}:{prose[: match.start()].count(chr(10)) + 1}")
    return list(found.values())


COMMANDS = _doc_commands()


def _subcommand(tokens: tuple[str, ...]) -> tuple[str, ...]:
    """The `fedprivacy` subcommand a command names: ('plan',), ('ledger', 'show'), or () for none."""
    words = [t for t in tokens[1:3] if not t.startswith("-")]
    if not words:
        return ()
    if words[0] == "ledger" and len(words) > 1 and not PLACEHOLDER.match(words[1]):
        return (words[0], words[1])
    return (words[0],)


def _has_placeholder(tokens: tuple[str, ...]) -> bool:
    return any(PLACEHOLDER.match(token) for token in tokens[1:])


def invoke(args: list[str]) -> tuple[int, str, str]:
    """`fedprivacy ARGS` in process: exit code, everything it printed, and its stdout alone."""
    result = CliRunner().invoke(app, args, env=WIDE)
    output = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        output += f"\n{type(result.exception).__name__}: {result.exception}"
    return result.exit_code, output, result.stdout


def _with_real_data(tokens: tuple[str, ...]) -> list[str]:
    """`../shared/data/…` (from the repository root) and `$PWD/../shared/data/…` as real paths."""
    real = []
    for token in tokens:
        for prefix in ("$PWD/../shared/data", "../shared/data"):
            if token.startswith(prefix):
                token = str(SHARED_DATA) + token[len(prefix) :]
                if not Path(token).exists():
                    pytest.skip(f"the docs' command reads {token}, which is not there")
        real.append(token)
    return real


def _redirect_out(args: list[str], out: Path) -> list[str]:
    """The command with its `--out` in `out`, so that nothing is written into the repository."""
    redirected = list(args)
    for i, token in enumerate(redirected[:-1]):
        if token == "--out":
            redirected[i + 1] = str(out)
    return redirected


# ---------------- `fedprivacy --help` for every subcommand named ----------------

SUBCOMMANDS: dict[tuple[str, ...], list[Command]] = {}
for _command in COMMANDS:
    if _command.tokens[0] == "fedprivacy":
        SUBCOMMANDS.setdefault(_subcommand(_command.tokens), []).append(_command)


@pytest.mark.parametrize("path", sorted(SUBCOMMANDS), ids=lambda p: " ".join(p) or "fedprivacy")
def test_every_fedprivacy_subcommand_the_docs_name_answers_help(path):
    code, output, _ = invoke([*path, "--help"])
    places = "; ".join(c.where() for c in SUBCOMMANDS[path])
    assert code == 0 and "Usage:" in output, f"`fedprivacy {' '.join(path)} --help` failed ({places}):\n{output}"


def test_the_docs_show_the_planning_and_sweep_commands():
    """The extraction itself: if it found nothing, every test above would pass vacuously."""
    assert {("plan",), ("sheets",), ("calculator",), ("sweep",), ("report",), ("ledger", "show")} <= set(SUBCOMMANDS)


# ---------------- `fedprivacy plan` and `sheets`, for real ----------------

RUNNABLE = [
    c
    for c in COMMANDS
    if c.tokens[0] == "fedprivacy" and _subcommand(c.tokens)[:1] in {(n,) for n in RUN_FOR_REAL}
    if len(c.tokens) > 2 and "--help" not in c.tokens and not _has_placeholder(c.tokens)  # an example, not a name
]


@pytest.mark.parametrize("command", RUNNABLE, ids=lambda c: c.text[:70])
def test_plan_and_sheets_examples_run_as_shown(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = _redirect_out(_with_real_data(command.tokens)[1:], tmp_path / "out")
    code, output, stdout = invoke(args)
    assert code == 0, f"{command.where()}\nexit {code}:\n{output}"
    if "--out" in args:
        assert list((tmp_path / "out").iterdir()), f"{command.where()}: --out wrote nothing"
    if "--json" in args:
        assert isinstance(json.loads(stdout), dict | list), f"{command.where()}: --json printed {stdout[:200]!r}"


def test_the_readme_tour_plan_gives_the_figures_it_states(tmp_path, monkeypatch):
    """README's "Plan a client": σ = 5.00, q = 0.1, T = 50, ε = 0.526; calibrated σ = 2.93."""
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    stated = re.search(
        r"the proactive rule gives σ = ([\d.]+), q = ([\d.]+) and T = (\d+), certified at ε = ([\d.]+).*?"
        r"`--rule calibrated` hands the rest back \(σ = ([\d.]+)\)",
        readme,
    )
    assert stated, "README.md no longer states the tour's plan in the words this test reads: update the test"
    monkeypatch.chdir(tmp_path)
    figures = {}
    for rule in ("proactive", "calibrated"):
        code, output, stdout = invoke(
            ["plan", "--n", "5736", "--epsilon", "1", "--delta", "1e-5", "--rule", rule, "--json"]
        )
        assert code == 0, f"README.md's tour plan, rule {rule}: {output}"
        figures[rule] = json.loads(stdout)
    sigma, q, steps, epsilon, calibrated_sigma = stated.groups()
    plan = figures["proactive"]
    assert f"{plan['sigma']:.2f}" == sigma, ("README.md", plan["sigma"])
    assert plan["sampling_rate"] == pytest.approx(float(q)) and plan["steps"] == int(steps), ("README.md", plan)
    assert f"{plan['epsilon_pld']:.3f}" == epsilon, ("README.md", plan["epsilon_pld"])
    assert f"{figures['calibrated']['sigma']:.2f}" == calibrated_sigma, ("README.md", figures["calibrated"]["sigma"])


# ---------------- sweeps and scenarios: dry-runs ----------------

SCENARIOS = sorted((ROOT / "scenarios").glob("*.toml"))


@pytest.fixture(scope="module")
def scenario_copy(tmp_path_factory) -> Path:
    """scenarios/ copied to <tmp>/repo/scenarios, with <tmp>/shared the real shared folder and
    <tmp>/repo/runs/pums-validation.csv standing in for the validation file (see the docstring)."""
    base = tmp_path_factory.mktemp("docs")
    shutil.copytree(ROOT / "scenarios", base / "repo" / "scenarios")
    if SHARED_DATA.is_dir():
        (base / "shared").symlink_to(SHARED_DATA.parent, target_is_directory=True)
    if PUMS.is_file():
        (base / "repo" / "runs").mkdir()
        (base / "repo" / "runs" / "pums-validation.csv").symlink_to(PUMS)
    return base / "repo" / "scenarios"


@pytest.fixture(scope="module")
def dry_run(scenario_copy, tmp_path_factory):
    """`fedprivacy sweep ARGS --dry-run` in process, each distinct command once: (exit code, output, cells)."""
    outs = tmp_path_factory.mktemp("sweeps")
    done: dict[tuple[str, ...], tuple[int, str, int | None]] = {}

    def run(args: list[str]) -> tuple[int, str, int | None]:
        key = tuple(a for i, a in enumerate(args) if i == 0 or args[i - 1] != "--out")
        if key not in done:
            args = _redirect_out(args if "--out" in args else [*args, "--out", "-"], outs / f"out{len(done)}")
            if "--dry-run" not in args:
                args = [*args, "--dry-run"]
            code, output, _ = invoke(["sweep", *args])
            counted = re.search(r":\s*(\d+)\s+cells\b", " ".join(output.split()))
            done[key] = (code, output, int(counted.group(1)) if counted else None)
        return done[key]

    return run


def _needs_pums(scenario: Path) -> bool:
    text = scenario.read_text(encoding="utf-8")
    return "shared/data/pums" in text or "pums-validation.csv" in text


def _copy_of(scenario: Path, scenario_copy: Path) -> str:
    return str(scenario_copy / scenario.name)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda p: p.name)
def test_every_scenario_file_dry_runs(scenario, scenario_copy, dry_run):
    if _needs_pums(scenario) and not PUMS.is_file():
        pytest.skip(f"{scenario.name} reads the PUMS extract, which is not at {PUMS}")
    code, output, cells = dry_run([_copy_of(scenario, scenario_copy)])
    assert code == 0 and cells, f"fedprivacy sweep scenarios/{scenario.name} --dry-run: exit {code}\n{output}"


def _named_scenarios() -> dict[str, list[str]]:
    """Every `scenarios/….toml` the docs name (globs such as pums_tuning*.toml too), with where."""
    named: dict[str, list[str]] = {}
    for doc in DOCS:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for name in re.findall(r"scenarios/([\w.*-]+\.toml)", line):
                named.setdefault(name, []).append(f"{_relative(doc)}:{number}")
    return named


NAMED_SCENARIOS = _named_scenarios()


@pytest.mark.parametrize("name", sorted(NAMED_SCENARIOS))
def test_every_scenario_the_docs_name_exists(name):
    assert list((ROOT / "scenarios").glob(name)), (
        f"{'; '.join(NAMED_SCENARIOS[name])}: scenarios/{name} names no file in scenarios/"
    )


SWEEPS = [c for c in COMMANDS if c.tokens[0] == "fedprivacy" and _subcommand(c.tokens) == ("sweep",)]
SWEEPS = [c for c in SWEEPS if len(c.tokens) > 2 and "--help" not in c.tokens and not _has_placeholder(c.tokens)]


@pytest.mark.parametrize("command", SWEEPS, ids=lambda c: c.text[:70])
def test_every_sweep_the_docs_show_dry_runs(command, scenario_copy, dry_run, monkeypatch):
    args = _with_real_data(command.tokens)[2:]
    if any(token.startswith("examples/custom_model/") for token in args):
        # The example's model, as `pip install -e examples/custom_model` would provide it (by
        # decoration here: the test session installs nothing), for this test only.
        from fedprivacy import model_registry

        monkeypatch.setattr(model_registry, "_decorated", {})
        monkeypatch.syspath_prepend(str(ROOT / "examples" / "custom_model" / "src"))
        from fedprivacy_gn_cnn.models import gn_cnn

        model_registry.register_model("gn-cnn")(gn_cnn)
    for i, token in enumerate(args):
        if token.startswith("scenarios/") and token.endswith(".toml"):
            scenario = ROOT / token
            assert scenario.is_file(), f"{command.where()}: {token} is not in scenarios/"
            if _needs_pums(scenario) and not PUMS.is_file():
                pytest.skip(f"{token} reads the PUMS extract, which is not at {PUMS}")
            args[i] = _copy_of(scenario, scenario_copy)
    code, output, cells = dry_run(args)
    assert code == 0 and cells, f"{command.where()} (run with --dry-run): exit {code}\n{output}"


# The cell counts the docs state: (doc, the sentence that states it, the scenarios it counts).
# A sentence reworded so that the pattern no longer finds it fails the test: update it here.
AGE_BANDS = ["pums_tuning_age_bands.toml", *(f"pums_tuning_age_bands{i}.toml" for i in range(2, 8))]
MLP_STAGES = [f"pums_tuning_{s}.toml" for s in ("mlp", "mlp2", "server", "rounds", "rounds2")]
CELL_CLAIMS = [
    ("README.md", r"these (\d+) cells and the non-private baseline", ["pums_budgets.toml"]),
    ("docs/experiments.md", r"\| whole sweep: (\d+) cells", ["pums_budgets.toml"]),
    ("docs/experiments.md", r"in five small stages, each reading the previous one \((\d+) cells", MLP_STAGES),
    ("docs/experiments.md", r"Seven more validation stages \((\d+) cells", AGE_BANDS),
    ("docs/experiments.md", r"`scenarios/pums_budgets_2cells\.toml`: (two) cells", ["pums_budgets_2cells.toml"]),
]
NUMBER_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5}


@pytest.mark.parametrize(("doc", "pattern", "scenarios"), CELL_CLAIMS, ids=[f"{d}:{s[0]}" for d, _, s in CELL_CLAIMS])
def test_the_cell_counts_the_docs_state_are_what_the_scenarios_dry_run_to(
    doc, pattern, scenarios, scenario_copy, dry_run
):
    text = " ".join((ROOT / doc).read_text(encoding="utf-8").split())
    stated = re.search(pattern, text)
    assert stated, f"{doc} no longer says /{pattern}/: update CELL_CLAIMS in tests/test_docs.py"
    if not PUMS.is_file():
        pytest.skip(f"these scenarios read the PUMS extract, which is not at {PUMS}")
    counts = {}
    for name in scenarios:
        code, output, cells = dry_run([str(scenario_copy / name)])
        assert code == 0 and cells, f"fedprivacy sweep scenarios/{name} --dry-run: exit {code}\n{output}"
        counts[name] = cells
    claim = stated.group(1)
    claimed = NUMBER_WORDS.get(claim) or int(claim)
    assert claimed == sum(counts.values()), f"{doc} says {stated.group(0)!r}; the dry-runs count {counts}"


def test_the_scenario_example_in_simulator_md_dry_runs_to_the_cells_it_states(scenario_copy, dry_run):
    """docs/simulator.md's TOML example, saved beside the shipped scenarios so its data path resolves."""
    text = (ROOT / "docs" / "simulator.md").read_text(encoding="utf-8")
    examples = [body for _, language, body in _fences(text) if language == "toml" and "[grid]" in body]
    assert examples, "docs/simulator.md shows no scenario example ([grid] in a toml block)"
    stated = re.search(r"= (\d+) cells", examples[0])
    assert stated, "docs/simulator.md's scenario example no longer states its cells ('= N cells')"
    if "shared/data/pums" in examples[0] and not PUMS.is_file():
        pytest.skip(f"the example reads the PUMS extract, which is not at {PUMS}")
    scenario = scenario_copy / "docs_simulator_example.toml"
    scenario.write_text(examples[0], encoding="utf-8")
    code, output, cells = dry_run([str(scenario)])
    assert code == 0, f"docs/simulator.md's scenario example (dry-run): exit {code}\n{output}"
    assert cells == int(stated.group(1)), f"docs/simulator.md says {stated.group(0)!r}; the dry-run counts {cells}"


# ---------------- python benchmarks/…, experiments/…, -m sims.…: --help ----------------


def _script(tokens: tuple[str, ...]) -> tuple[str, str] | None:
    """('path', 'benchmarks/x.py') or ('module', 'sims.x') for a command this test asks for --help."""
    if len(tokens) > 1 and re.fullmatch(r"(benchmarks|experiments)/\w+\.py", tokens[1]):
        return ("path", tokens[1])
    if len(tokens) > 2 and tokens[1] == "-m" and tokens[2].startswith("sims."):
        return ("module", tokens[2])
    return None


NOT_RUN = {("-m", "pytest"), ("-m", "venv"), ("-m", "fedprivacy.runconfig_docs")}  # see the module docstring
SCRIPTS: dict[tuple[str, str], list[Command]] = {}
for _command in COMMANDS:
    if _command.tokens[0] != "fedprivacy" and _script(_command.tokens):
        SCRIPTS.setdefault(_script(_command.tokens), []).append(_command)


def test_every_python_command_the_docs_show_is_covered_here():
    """A new kind of `python …` command in the docs must be run here or named in NOT_RUN."""
    for command in COMMANDS:
        if command.tokens[0] == "fedprivacy" or _script(command.tokens):
            continue
        assert tuple(command.tokens[1:3]) in NOT_RUN or command.tokens[1] == "-c", (
            f"{command.where()}: tests/test_docs.py neither runs this command nor says why not"
        )


@pytest.mark.parametrize("script", sorted(SCRIPTS), ids=lambda s: s[1])
def test_every_script_the_docs_show_answers_help(script, monkeypatch):
    kind, name = script
    places = "; ".join(c.where() for c in SCRIPTS[script])
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    printed = io.StringIO()
    with pytest.raises(SystemExit) as ended, contextlib.redirect_stdout(printed):
        if kind == "path":
            assert (ROOT / name).is_file(), f"{places}: {name} is not in the repository"
            runpy.run_path(str(ROOT / name), run_name="__main__")
        else:
            try:
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            except ImportError as error:
                pytest.fail(f"{places}: python -m {name} cannot run: {error}")
    assert ended.value.code in (0, None) and "usage" in printed.getvalue().lower(), (
        f"{places}: `{name} --help` exited {ended.value.code}:\n{printed.getvalue()}"
    )


# ---------------- links between the docs ----------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug, n = _slug(heading), 1
        while slug in anchors:
            slug, n = f"{_slug(heading)}-{n}", n + 1
        anchors.add(slug)
    return anchors


LINKED = [ROOT / "SECURITY.md", ROOT / "CHANGELOG.md", *DOCS]


@pytest.mark.parametrize("doc", LINKED, ids=_relative)
def test_relative_links_point_at_files_and_headings_that_exist(doc):
    text = re.sub(r"^```.*?^```", "", doc.read_text(encoding="utf-8"), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target} (no such heading in {_relative(path)})")
    assert not broken, f"{_relative(doc)}: broken links: {broken}"
