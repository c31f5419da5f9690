"""Every ```bash block of README.md and docs/*.md runs as written from the repository root.

Each block runs with `bash -e -o pipefail` in a copy of the repository (so the checkout stays
clean) whose parent holds `shared/` as a link to this checkout's `../shared`, the public traces'
place. `simkv` there is the copy's own code. A block is skipped, with its reason, when the line
directly above its opening fence is `<!-- docs-test: skip (reason) -->`, or when it needs
../shared/traces and they are absent. A block may write only git-ignored paths (`runs/`,
`results/`) or outside the copy (/tmp).
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
TRACES = SHARED / "traces"
SKIP_MARK = re.compile(r"^\s*<!-- docs-test: skip \((?P<reason>.+)\) -->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
SHELLS = {"bash", "sh", "shell"}
BLOCK_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    file: str          # relative to the repository root
    line: int          # the opening fence's line, from 1
    code: str
    skip_reason: str | None

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and docs/*.md, in a stable order."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def shell_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The ```bash (or sh/shell) blocks of one Markdown file, with their skip markers."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        if m["lang"] in SHELLS:
            mark = SKIP_MARK.match(lines[i - 1]) if i > 0 else None
            indent = len(m["indent"])
            code = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
            blocks.append(Block(str(path.relative_to(root)), i + 1, code,
                                mark["reason"] if mark else None))
        i = end + 1
    return blocks


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [b for path in doc_files(root) for b in shell_blocks(path, root)]


def needs_traces(block: Block, root: Path = ROOT) -> bool:
    """Whether the block reads ../shared/traces, itself or through a scenario it names."""
    if "shared/traces" in block.code:
        return True
    for name in re.findall(r"scenarios/[\w./-]+\.ya?ml", block.code):
        scenario = root / name
        if scenario.is_file() and "shared/traces" in scenario.read_text():
            return True
    return False


BLOCKS = all_blocks()


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def _ignored(paths: list[str]) -> set[str]:
    """The paths the repository's .gitignore ignores (git check-ignore on path names)."""
    if not paths:
        return set()
    done = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", "--stdin"],
                          input="\n".join(paths), capture_output=True, text=True)
    return set(done.stdout.split())


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A copy of the repository's files beside a link to ../shared; a `simkv` of its own code."""
    base = tmp_path_factory.mktemp("docs")
    repo = base / ROOT.name
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard"],
                            capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("the repository's file list needs git (git ls-files failed)")
    for name in listed.stdout.splitlines():
        src = ROOT / name
        if src.is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / name)
    if SHARED.is_dir():
        (base / "shared").symlink_to(SHARED, target_is_directory=True)
    bin_dir = base / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "simkv"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m simkv.cli "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return repo


def test_every_skip_marker_sits_directly_above_a_shell_block():
    marker_lines = []
    for path in doc_files():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "docs-test:" in line:
                marker_lines.append((str(path.relative_to(ROOT)), n + 1))
    marked = {(b.file, b.line) for b in BLOCKS if b.skip_reason}
    assert [m for m in marker_lines if m not in marked] == []


def test_the_blocks_are_found_with_their_markers(tmp_path):
    doc = tmp_path / "README.md"
    doc.write_text("text\n```bash\necho one\n```\n<!-- docs-test: skip (needs a GPU) -->\n"
                   "```bash\nnvidia-smi\n```\n```python\nprint(1)\n```\n  ```sh\n  echo two\n  ```\n")
    found = shell_blocks(doc, tmp_path)
    assert [(b.line, b.code, b.skip_reason) for b in found] == [
        (2, "echo one\n", None), (6, "nvidia-smi\n", "needs a GPU"), (12, "echo two\n", None)]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_the_documented_commands_run_as_written(block: Block, clone: Path):
    if block.skip_reason:
        pytest.skip(f"{block.id}: {block.skip_reason}")
    if needs_traces(block) and not TRACES.is_dir():
        pytest.skip(f"{block.id}: needs the public traces in {TRACES} (README: Public traces)")
    env = dict(os.environ, PYTHONPATH=str(clone), PYTHONDONTWRITEBYTECODE="1",
               PATH=f"{clone.parent / 'bin'}{os.pathsep}{Path(sys.executable).parent}"
                    f"{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("VIRTUAL_ENV_PROMPT", None)
    before = _files(clone)
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert done.returncode == 0, (
        f"{block.id} exited {done.returncode}\n--- block\n{block.code}--- stdout (tail)\n"
        f"{done.stdout[-3000:]}\n--- stderr (tail)\n{done.stderr[-3000:]}")
    new = sorted(_files(clone) - before)
    assert sorted(set(new) - _ignored(new)) == [], f"{block.id} wrote files git would track"


def test_ci_runs_the_readmes_test_command_which_lists_skip_reasons():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    command = ci.split("&& ", 1)[1]       # after creating the virtualenv
    assert command in readme and "pytest -q -rs" in command
