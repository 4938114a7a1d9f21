# SPDX-License-Identifier: Apache-2.0
"""The documentation check CI runs: fast, in-process, no ranks.

- README.md and docs/ speak of the product only: no words of how the work was organised (run labels, issue numbers).
- docs/config.md documents every key of ``CompileConfig`` with its type and default, and no key that is gone.
- Every file path the README, the reference docs and the code's comments name exists (history names files as they
  were then), every section they name by its title exists there, and every flag a command in README.md or docs/ gives
  a benchmark or script is one that script takes.
- Every relative Markdown link resolves, anchors included.
- docs/benchmarks.md is a reference: at most 400 lines, each results table followed by the line that says where it was
  measured (machine, commit, date, command, spread); every figure of the README's results is in it; every history
  entry, and each of its sections, is in the history index.
- Every source file starts with its SPDX licence header.
"""
import json
import re
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

from machine import unavailable_here

REPO = Path(__file__).resolve().parents[3]
README = REPO / "README.md"
DOCS = REPO / "docs"
HISTORY = DOCS / "history"
PACKAGE = REPO / "deepspeed" / "compile"


def markdown_files() -> List[Path]:
    return [README] + sorted(DOCS.rglob("*.md"))


def reference_files() -> List[Path]:
    """README and the reference docs: what must describe the tree as it is (history describes what was)."""
    return [p for p in markdown_files() if HISTORY not in p.parents]


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# ---- (a) the product's words only -------------------------------------------------------------------------------
# Words a reader of the product cannot know: labels of the runs that produced it, issue numbers, and words about how
# the work was organised. Dates, commits and versions say when instead.
WORKFLOW_WORDS = [
    r"\bstops? \d+",  # "stop 50", "stops 24-46"
    r"\bstop-\d+",
    r"\b(?:this|last|next|previous) stop\b",
    r"\bstop's\b",
    r"\bissues? #?\d+",  # "issue 11", "issues 11 and 15"
    r"\bissue's\b",
    r"\bsessions?\b",
    r"\bfiled\b",
    r"\bout/s\d+_",  # an output directory named after a run label
]


def workflow_hits(text: str) -> List[Tuple[int, str]]:
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in WORKFLOW_WORDS:
            for match in re.finditer(pattern, line, flags=re.IGNORECASE):
                hits.append((number, match.group(0)))
    return hits


def test_workflow_words_are_caught():
    assert workflow_hits("at stop 50 it was measured") == [(1, "stop 50")]
    assert [w for _, w in workflow_hits("Issue 11's target; issues 11 and 15\nthis session")] == [
        "Issue 11", "issues 11", "session"]
    # ordinary words stay allowed
    assert workflow_hits("backward stops there; a wait that stops; the op issues a collective; `--steps 12`") == []


@pytest.mark.parametrize("path", markdown_files(), ids=rel)
def test_docs_use_no_workflow_vocabulary(path: Path):
    hits = workflow_hits(path.read_text())
    assert not hits, f"{rel(path)}: words of the workflow, not the product (use dates, commits, versions): " + \
        ", ".join(f"line {n}: {word!r}" for n, word in hits)


# ---- (b) every config key documented with its default -----------------------------------------------------------
def key_tables(text: str) -> Dict[str, Tuple[str, str]]:
    """Rows of the Markdown tables whose header is ``| key | type | default | effect |``: key -> (type, default) cells.
    A key cell is one `name`, or a link to the key's own section."""
    rows, columns = {}, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            columns = None
        elif cells[:3] == ["key", "type", "default"]:
            columns = cells
        elif columns and not set(cells[0]) <= set("-: "):
            key = re.fullmatch(r"\[?`(\w+)`(?:\]\(#[\w-]+\))?", cells[0])
            assert key, f"docs/config.md: a key cell that is not one `name`: {cells[0]!r}"
            rows[key.group(1)] = (cells[1], cells[2])
    return rows


def compile_config_fields():
    import deepspeed.compile.config as config
    if PACKAGE not in Path(config.__file__).resolve().parents:
        unavailable_here("checkout", config.__file__)
    return config.CompileConfig.model_fields


def test_every_config_key_is_documented_with_its_default():
    fields = compile_config_fields()
    documented = key_tables((DOCS / "config.md").read_text())
    missing = sorted(set(fields) - set(documented))
    stale = sorted(set(documented) - set(fields))
    assert not missing, f"docs/config.md documents no row for {missing}"
    assert not stale, f"docs/config.md documents keys CompileConfig no longer has: {stale}"
    wrong = {}
    for name, field in fields.items():
        cell = documented[name][1]
        value = re.fullmatch(r"`(.+)`", cell)
        try:
            shown = json.loads(value.group(1)) if value else cell
        except json.JSONDecodeError:
            shown = cell
        if shown != field.default or isinstance(shown, bool) != isinstance(field.default, bool):
            wrong[name] = (cell, field.default)
    assert not wrong, f"docs/config.md: defaults that are not config.py's (documented, actual): {wrong}"


def type_words(annotation) -> set:
    """What a key's type cell must name: each literal value (as JSON), and the plain types by name."""
    import typing
    if typing.get_origin(annotation) is typing.Annotated:
        return type_words(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) is typing.Literal:
        return {json.dumps(v) for v in typing.get_args(annotation)}
    if typing.get_args(annotation):
        return set().union(*(type_words(a) for a in typing.get_args(annotation) if a is not type(None)))
    return {getattr(annotation, "__name__", str(annotation))}


def test_every_config_key_has_its_type():
    wrong = {}
    for name, (cell, _) in key_tables((DOCS / "config.md").read_text()).items():
        field = compile_config_fields().get(name)
        words = type_words(field.annotation) if field else set()
        if any(word not in cell.replace("list", "List") and word.lower() not in cell for word in words):
            wrong[name] = (cell, sorted(words))
    assert not wrong, f"docs/config.md: type cells that do not name config.py's type (cell, expected): {wrong}"


# ---- (c) paths and commands the docs name exist -----------------------------------------------------------------
TOP_LEVEL = r"(?:\.ci|benchmarks|csrc|deepspeed|docs|requirements|scripts|tests)"
# a path from the repository root, or one inside the package as the docs write them (`driver/regions.py`)
ROOT_PATH = re.compile(rf"(?<![\w./-]){TOP_LEVEL}/[\w./*-]*[\w/*]|(?<![\w./-])(?:LICENSE|setup\.py|MANIFEST\.in)\b")
PACKAGE_PATH = re.compile(r"(?<![\w./-])(?:capture|graph|native|passes|runtime|schedule)/\w+\.py\b")


def code_text(text: str) -> Iterator[str]:
    """Inline code spans and indented code lines: where the docs name files and commands."""
    for line in text.splitlines():
        if line.startswith("    "):
            yield line
        yield from re.findall(r"`([^`]+)`", line)


def named_paths(text: str) -> List[Tuple[str, str]]:
    """(base, path) for each path in code: base "" is the repository root, "pkg" the package (links: below)."""
    found = []
    for code in code_text(text):
        found += [("", m) for m in ROOT_PATH.findall(code)] + [("pkg", m) for m in PACKAGE_PATH.findall(code)]
    return sorted(set(found))


@pytest.mark.parametrize("path", reference_files(), ids=rel)
def test_named_paths_exist(path: Path):
    missing = []
    for kind, name in named_paths(path.read_text()):
        base = PACKAGE if kind == "pkg" else REPO
        exists = any(base.glob(name.rstrip("/"))) if "*" in name else (base / name.rstrip("/")).exists()
        if not exists:
            missing.append(name)
    assert not missing, f"{rel(path)} names paths that do not exist: {missing}"


def test_readme_names_the_two_commands_and_they_exist():
    text = README.read_text()
    for command in ("bash scripts/main_job.sh", "bash .ci/run"):
        assert re.search(rf"^    {re.escape(command)}\s", text, flags=re.MULTILINE), f"README lost `{command}`"
    assert (REPO / "scripts" / "main_job.sh").is_file() and (REPO / ".ci" / "run").is_file()
    assert len(text.splitlines()) <= 150, "README.md is meant to be read in a minute: at most 150 lines"


SCRIPT_CALL = re.compile(r"((?:benchmarks|scripts)/\w+\.py|\b(?:run|steady_step)\.py)((?:\s+[^#`|]*)?)")


def documented_flags(text: str) -> Iterator[Tuple[str, str]]:
    """(script, --flag) for each flag a documented command gives a repository script; commands continue over
    backslash-ended lines, and ``$S`` stands for ``steady_step.py`` where the docs define it so."""
    lines, joined = text.splitlines(), []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line.strip()
        else:
            joined.append(line)
    steady = any(re.search(r'S="[^"]*steady_step\.py"', line) for line in joined)
    for line in joined:
        if steady:
            line = re.sub(r"\$S\b", "benchmarks/steady_step.py", line)
        for script, args in SCRIPT_CALL.findall(line):
            if "/" not in script:
                script = "benchmarks/" + script
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", args):
                yield script, flag


def script_flags(source: Path) -> set:
    """The flags a script defines, with those of the modules beside it that it imports (``worker.py``'s shared ones)."""
    texts = [source.read_text()]
    names = set()
    for module, imported in re.findall(r"^\s*(?:from\s+([\w.]+)\s+)?import\s+([\w, ]+)", texts[0], flags=re.MULTILINE):
        names |= {module.split(".")[-1]} | {n.strip() for n in imported.split(",")}
    for name in sorted(names - {""}):
        sibling = source.parent / f"{name}.py"
        if sibling.is_file() and sibling != source:
            texts.append(sibling.read_text())
    return set(re.findall(r"""["'](--[a-z][\w-]*)["']""", "\n".join(texts)))


@pytest.mark.parametrize("path", markdown_files(), ids=rel)
def test_documented_flags_are_flags_of_their_script(path: Path):
    """argparse takes a unique prefix of a flag too (``--row`` for ``--rows``), as the scripts are run."""
    unknown = set()
    for script, flag in documented_flags(path.read_text()):
        source = REPO / script
        if not source.is_file():
            unknown.add(f"{script} (no such script)")
            continue
        flags = script_flags(source)
        if not any(f == flag or f.startswith(flag) for f in flags):
            unknown.add(f"{script} {flag}")
    assert not unknown, f"{rel(path)}: commands with flags their script does not take: {sorted(unknown)}"


# ---- (d) relative links resolve ----------------------------------------------------------------------------------
def anchors(path: Path) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped but hyphens, spaces as hyphens."""
    found = set()
    for line in path.read_text().splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(slug)
    return found


@pytest.mark.parametrize("path", markdown_files(), ids=rel)
def test_relative_links_resolve(path: Path):
    broken = []
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(target)
    assert not broken, f"{rel(path)}: links that do not resolve: {broken}"


# ---- (d') sections named by title, in the docs and in the code's comments -------------------------------------
CODE_DIRS = ("deepspeed", "benchmarks", "scripts", "tests")


def code_files() -> List[Path]:
    skip = {"__pycache__", "build", ".venv", "out"}
    return [p for top in CODE_DIRS for p in sorted((REPO / top).rglob("*.py"))
            if not skip & set(p.relative_to(REPO).parts) and p != Path(__file__).resolve()]  # this file: examples


def flat(text: str) -> str:
    """Text with its lines joined (comment markers dropped), so a reference may span lines."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)


def titles(path: Path) -> List[str]:
    """The headings of a page, and its run-in bold headings (``**Failures agree across ranks.**``), normalized."""
    found = re.findall(r"^#{1,6}\s+(.*)$|^\*\*([^*]+?)\.?\*\*", path.read_text(), flags=re.MULTILINE)
    return [norm(a or b) for a, b in found]


def norm(title: str) -> str:
    return re.sub(r"\s+", " ", title.replace("`", "")).strip().lower()


# `docs/x.md`, "Title" or [text](x.md#anchor), "Title": a page, then a section named by (the start of) its title
SECTION_REF = re.compile(r"((?:docs/)?[\w./-]+\.md)(?:#[\w-]*)?`?\)?,\s+\"([^\"]+)\"")


def section_refs(path: Path) -> List[Tuple[Path, str]]:
    refs = []
    for page, title in SECTION_REF.findall(flat(path.read_text())):
        base = REPO if page.startswith("docs/") else path.parent
        refs.append(((base / page).resolve(), title))
    return refs


def test_section_references_are_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text('# Title\n\n## The runtime\n\n**Run-in heading.** text\n')
    text = flat('See (`page.md`, "The runtime"), [it](page.md#the-runtime), "Run-in heading" and\n# (`page.md`,\n'
                '# "No such part").')
    refs = [title for name, title in SECTION_REF.findall(text)]
    assert refs == ["The runtime", "Run-in heading", "No such part"]
    assert [t for t in refs if not any(norm(t) in h for h in titles(page))] == ["No such part"]


@pytest.mark.parametrize("path", reference_files() + code_files(), ids=rel)
def test_named_pages_and_sections_exist(path: Path):
    missing = [rel(REPO / m) for m in re.findall(r"(?<![\w/.-])docs/[\w/.-]*\w\.md", path.read_text())
               if not (REPO / m).is_file()]
    assert not missing, f"{rel(path)} names pages that do not exist: {missing}"
    gone = [f"{page.name}: {title!r}" for page, title in section_refs(path)
            if page.is_file() and not any(norm(title) in t for t in titles(page))]
    assert not gone, f"{rel(path)} names sections their page does not have (by words of the title): {gone}"


# ---- (d'') the benchmarks are a reference ----------------------------------------------------------------------
BENCHMARKS = DOCS / "benchmarks.md"
FIGURE = re.compile(r"\d\.\d+x\b|\b\d+(?:\.\d+)? (?:s|ms|us|MiB|GiB)\b")
MACHINES = ("Intel Xeon", "AMD EPYC")


def results_tables(text: str) -> Iterator[Tuple[int, List[str], str, str]]:
    """(line number, the table's lines, the text of its section before it, the paragraph after it) for each table
    with a measured figure in its body: a ratio, seconds or bytes."""
    lines = text.splitlines()
    i, section_start = 0, 0
    while i < len(lines):
        if lines[i].startswith("#"):
            section_start = i
        if lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            k = j + 1 if j < len(lines) and not lines[j].strip() else j
            after = []
            while k < len(lines) and lines[k].strip():
                after.append(lines[k])
                k += 1
            if any(FIGURE.search(line) for line in lines[i + 2:j]):
                yield i + 1, lines[i:j], "\n".join(lines[section_start:i]), " ".join(after)
            i = j
        i += 1


def unmeasured(text: str) -> List[str]:
    """Each results table whose next paragraph is not a "Measured:" line naming the machine, the commit (or the table
    has a commit column), the date, the command (in the line, or a command in its section) and the spread."""
    bad = []
    for number, table, before, after in results_tables(text):
        wants = {
            "Measured:": after.startswith("Measured:"),
            "machine": any(m in after for m in MACHINES),
            "commit": bool(re.search(r"`[0-9a-f]{7,40}`", after)) or "commit" in table[0],
            "date": bool(re.search(r"\b20\d\d-\d\d-\d\d\b", after)),
            "command": "python" in after or bool(re.search(r"^    .*python", before, flags=re.MULTILINE)),
            "spread": bool(re.search(r"round|one launch|launches|interval", after))
            or ("spread in the table" in after and "spread" in table[0]),
        }
        if not all(wants.values()):
            bad.append(f"line {number}: lacks " + ", ".join(k for k, ok in wants.items() if not ok))
    return bad


def test_benchmarks_are_a_reference_of_at_most_400_lines():
    assert len(BENCHMARKS.read_text().splitlines()) <= 400, "docs/benchmarks.md: dated narratives go to docs/history"


def test_a_results_table_without_its_measured_line_is_caught():
    table = "    python benchmarks/run.py\n\n| a | b |\n|---|---|\n| x | 0.52x |\n\n"
    line = "Measured: Intel Xeon, commit `6624851`, 2026-12-05, the command above; 3 rounds."
    assert unmeasured("## Q\n" + table + line + "\n") == []
    assert unmeasured("## Q\n" + table + "Measured: commit `6624851`, 2026-12-05; 3 rounds.\n") == [
        "line 4: lacks machine"]
    assert unmeasured("## Q\n" + table.replace("    python benchmarks/run.py", "") + line.replace("rounds", "")) \
        == ["line 4: lacks command, spread"]


def test_every_results_table_says_where_it_was_measured():
    bad = unmeasured(BENCHMARKS.read_text())
    assert not bad, f"docs/benchmarks.md: results tables without their machine/commit/date/command/spread line: {bad}"


def test_every_readme_figure_is_in_the_benchmarks():
    shown = set(re.findall(r"\d+\.\d+x", README.read_text()))
    missing = sorted(shown - set(re.findall(r"\d+\.\d+x", BENCHMARKS.read_text())))
    assert not missing, f"README.md shows figures docs/benchmarks.md does not have: {missing}"


def test_every_history_entry_and_section_is_in_the_index():
    index = (HISTORY / "README.md").read_text()
    missing = []
    for entry in sorted(HISTORY.glob("20*.md")):
        line = next((l for l in index.splitlines() if f"]({entry.name})" in l), None)
        if line is None:
            missing.append(entry.name)
            continue
        missing += [f"{entry.name}: {t}" for t in re.findall(r"^## (.*)$", entry.read_text(), flags=re.MULTILINE)
                    if t not in line]
    assert not missing, f"docs/history/README.md does not index: {missing}"


# ---- (e) licence headers ------------------------------------------------------------------------------------------
SPDX = "SPDX-License-Identifier: Apache-2.0"
SOURCE_DIRS = ("benchmarks", "csrc", "deepspeed", "scripts", "tests")
SKIP_DIRS = {"__pycache__", "build", ".venv", "out"}


def source_files() -> Iterator[Path]:
    for top in SOURCE_DIRS:
        for path in sorted((REPO / top).rglob("*")):
            if path.is_file() and not SKIP_DIRS & set(path.relative_to(REPO).parts) and \
                    path.suffix in (".py", ".sh", ".cpp", ".h", ".cu", ".cuh"):
                yield path
    yield REPO / "setup.py"
    yield REPO / ".ci" / "run"


def has_header(path: Path) -> bool:
    lines = path.read_text().splitlines()
    if lines and lines[0].startswith("#!"):
        lines = lines[1:]
    comment = "//" if path.suffix in (".cpp", ".h", ".cu", ".cuh") else "#"
    return bool(lines) and lines[0] == f"{comment} {SPDX}"


def test_every_source_file_has_the_spdx_header():
    missing = [rel(p) for p in source_files() if not has_header(p)]
    assert not missing, f"files without '{SPDX}' as their first line (after a shebang): {missing}"


# a skip other than machine.unavailable_here's: pytest's own calls and markers (this file names them only here)
OTHER_SKIPS = re.compile(r"pytest\.(skip|xfail|importorskip)\(|mark\.(skip|skipif|xfail)\b")


def test_every_skip_is_one_the_machine_list_allows_outside_ci():
    """A test skips only through ``machine.unavailable_here`` (for a fact about the machine, named in its one list
    ``ALLOWED_OUTSIDE_CI``), which fails under CI instead: nothing skips silently in CI."""
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in sorted((REPO / "tests").rglob("*.py"))
             if path.name not in ("machine.py", "test_docs.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if OTHER_SKIPS.search(line)]
    assert not found, found
