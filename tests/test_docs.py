"""The README and docs/ cannot drift from the code.

Every ```python block of README.md and docs/*.md runs, on CPU, as it is printed: all of them in
one child process (each block in a fresh namespace and an empty working directory), started the
way ``torchrun --nproc-per-node 1`` starts a script (RANK, WORLD_SIZE, MASTER_ADDR/PORT set), so
a block calls ``torch.distributed.init_process_group("gloo")`` as a user's script would. Blocks
of shell commands are ```bash and output ```text; every fence names its language, so no Python
block can escape. The ``examples/train_gpt.py`` flags the documents name exist in its
``--help``, docs/training_cli.md lists exactly its flags, and every link between the pages
reaches a file and a heading that exist.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, load_train_gpt
from tests.distributed import free_port

DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LANGUAGES = {"python", "bash", "text"}
# Pages the feature table links to that other work adds; once there they are checked like the rest.
PENDING = {"docs/training_step.md", "docs/context_parallel.md", "docs/architecture.md"}
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*) *$")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def rel(path) -> str:
    return path.relative_to(ROOT).as_posix()


def blocks(path) -> list[tuple[int, str, str]]:
    """(line of the opening fence, language, dedented text) of every fenced block in ``path``."""
    found, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{rel(path)}:{i + 1}: a fence that is never closed"
        body = textwrap.dedent("\n".join(lines[i + 1 : end]))
        found.append((i + 1, opening["lang"], body))
        i = end + 1
    return found


PYTHON_BLOCKS = [(f"{rel(p)}:{line}", text)
                 for p in DOCS for line, lang, text in blocks(p) if lang == "python"]

RUNNER = r"""
import json, os, sys, tempfile, traceback

results = {}
for name, code in json.load(open(sys.argv[1])):
    os.chdir(tempfile.mkdtemp(prefix="doc_block_"))
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
        results[name] = None
    except BaseException:  # noqa: BLE001  (reported by the test of this block)
        results[name] = traceback.format_exc()
    finally:
        import torch.distributed as dist
        from megatron_ext import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
json.dump(results, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def block_results(tmp_path_factory) -> dict[str, str | None]:
    """Runs every Python block in one child process; a block's traceback, or None if it ran."""
    work = tmp_path_factory.mktemp("doc_blocks")
    (work / "blocks.json").write_text(json.dumps(PYTHON_BLOCKS))
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-c", RUNNER, str(work / "blocks.json"), str(work / "results.json")]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((work / "results.json").read_text())


@pytest.mark.parametrize("name", [name for name, _ in PYTHON_BLOCKS])
def test_python_block_runs(block_results, name):
    assert block_results[name] is None, f"{name} failed:\n{block_results[name]}"


def test_every_fence_names_its_language():
    untagged = [f"{rel(p)}:{line} ({lang or 'none'})" for p in DOCS for line, lang, _ in blocks(p)
                if lang not in LANGUAGES]
    assert not untagged, f"fences without one of {sorted(LANGUAGES)}: {untagged}"
    assert len(PYTHON_BLOCKS) >= 5  # the README's, and the package pages'


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    assert lines[0] == "# megatron_ext"
    # CI runs `./dev.sh test`: the README opens with the two commands.
    assert lines[2] == "```bash" and lines[5] == "```"
    assert lines[3].startswith("./dev.sh train ") and lines[4].startswith("./dev.sh test ")


def train_gpt_help() -> set[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        load_train_gpt().parse_args(["--help"])
    # The options section: each option's line starts with its flags, comma-separated, each with its
    # metavar (after "-h, " for --help).
    starts = re.findall(r"^  (-.*?)(?:  |$)", out.getvalue(), re.M)
    flags = {flag for start in starts for flag in re.findall(r"(?:^|, )(--[a-z][a-z0-9-]*)", start)}
    assert {"--tp", "--tensor-model-parallel-size", "--pp", "--save", "--load-hf"} <= flags
    return flags


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def named_train_gpt_flags() -> dict[str, set[str]]:
    """The flags each document gives ``examples/train_gpt.py`` (after ``train_gpt.py`` or
    ``dev.sh train`` in a command or a code span; in docs/training_cli.md every ``--flag`` span)."""
    named = {}
    for path in DOCS:
        text = path.read_text()
        commands = [b.replace("\\\n", " ") for _, lang, b in blocks(path) if lang == "bash"]
        lines = [line for b in commands for line in b.splitlines()] + code_spans(text)
        flags = set()
        for line in lines:
            match = re.search(r"train_gpt\.py|dev\.sh train", line)
            if match:
                flags |= set(FLAG.findall(line[match.end() :]))
        if path.name == "training_cli.md":
            flags |= {f for span in code_spans(text) if span.startswith("--") for f in FLAG.findall(span)}
        named[rel(path)] = flags
    return named


def test_train_gpt_flags_in_the_docs_exist():
    known = train_gpt_help()
    named = named_train_gpt_flags()
    assert len(named["docs/training_cli.md"]) > 20
    unknown = {doc: sorted(flags - known) for doc, flags in named.items() if flags - known}
    assert not unknown, f"flags examples/train_gpt.py does not have: {unknown}"
    cli = (ROOT / "docs" / "training_cli.md").read_text()
    cells = re.findall(r"^\| (`--[^|]*) \|", cli, re.M)  # a row's first cell: its flag and aliases
    table = {flag for cell in cells for flag in re.findall(r"`(--[a-z][a-z0-9-]*)`", cell)}
    known -= {"--help"}
    assert table == known, f"training_cli.md: lacks {sorted(known - table)}, extra {sorted(table - known)}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def prose(path) -> str:
    """``path``'s text without its fenced blocks."""
    kept, inside = [], False
    for line in path.read_text().splitlines():
        if inside:
            inside = line.strip() != "```"
        elif FENCE.match(line):
            inside = True
        else:
            kept.append(line)
    return "\n".join(kept)


def anchors(path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#+ (.+)$", prose(path), re.M)}


def test_links_reach_pages_and_headings():
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(path)):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if file and rel(dest) in PENDING and not dest.exists():
                continue
            if not dest.exists():
                broken.append(f"{rel(path)}: {target} (no such file)")
            elif anchor and anchor not in anchors(dest):
                broken.append(f"{rel(path)}: {target} (no such heading)")
    assert not broken, broken
