"""The README and the docs: the README's first Python example runs as written, the README stays
short and starts with the set-up commands, and every relative link in README.md, CHANGELOG.md and
docs/*.md points to an existing file (and, for ``#anchor`` links into a Markdown file, to one of its
headings)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```")
_LINK = re.compile(r"\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)\)")


def _outside_code(text: str) -> list[str]:
    """The lines of ``text`` outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def anchors(path: pathlib.Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation other than ``-`` and
    ``_`` dropped, spaces as ``-``; a repeated heading gets ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in _outside_code(path.read_text(encoding="utf-8")):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(path: pathlib.Path) -> list[str]:
    """Targets of the Markdown links of ``path`` (outside code, inline code spans removed) that are
    not absolute URLs."""
    links = []
    for line in _outside_code(path.read_text(encoding="utf-8")):
        line = re.sub(r"`[^`]*`", "", line)
        for target in _LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                links.append(target)
    return links


def first_python_block(text: str) -> str:
    m = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert m, "README.md has no ```python block"
    return m.group(1)


def test_readme_is_short_and_starts_with_the_setup_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 400
    m = re.search(r"^```bash\n(.*?)^```", text, re.S | re.M)
    assert m and text.index(m.group(0)) < text.index("\n## ")  # the first block, before any section
    commands = [line.split("#")[0].strip() for line in m.group(1).splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert path.exists(), path
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_cited_result_files_exist():
    """Every ``eval/results/...`` file that README.md, CHANGELOG.md or docs/*.md names exists
    (``<model>`` stands for each embedded model; plots are regenerated, not committed)."""
    missing = []
    for path in DOCS:
        for cited in set(re.findall(r"eval/results/[\w./<>-]*\w", path.read_text(encoding="utf-8"))):
            if cited.endswith(".png") or cited.endswith("/"):
                continue
            for name in {cited.replace("<model>", m) for m in ("smollm2", "gemma3-270m")}:
                if not (ROOT / name).exists():
                    missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "\n".join(sorted(missing))


def test_link_check_finds_broken_links(tmp_path):
    """The checker itself: GitHub's slugs (code spans, punctuation, repeats) and what counts as a link."""
    doc = tmp_path / "a.md"
    doc.write_text("# Quality (`python -m eval.quality`, i.e. `make bench-quality`)\n## Notes\n## Notes\n"
                   "```\n## not a heading\n[in code](nowhere.md)\n```\n"
                   "[ok](#notes-1) [web](https://example.com) `[span](nowhere.md)` [gone](b.md#x)\n")
    assert anchors(doc) == {"quality-python--m-evalquality-ie-make-bench-quality", "notes", "notes-1"}
    assert relative_links(doc) == ["#notes-1", "b.md#x"]


@pytest.mark.slow
def test_readme_first_python_example_runs_as_written(tmp_path):
    """The first ```python block of README.md, exec'd as written in a fresh process (one thread),
    on the embedded model; it prints an answer."""
    code = first_python_block(README.read_text(encoding="utf-8"))
    script = tmp_path / "readme_example.py"
    script.write_text(textwrap.dedent("""\
        import torch
        torch.set_num_threads(1)
        namespace = {"__name__": "__main__"}
        exec(compile(open(%r).read(), "README.md example", "exec"), namespace)
        """) % str(tmp_path / "example.py"))
    (tmp_path / "example.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    printed = [line for line in run.stdout.splitlines() if line.strip()]
    assert printed, f"the example printed nothing; stderr: {run.stderr[-2000:]}"
    assert any(re.search(r"[A-Za-z]{3}", line) for line in printed), run.stdout


def readme_blocks(text: str, language: str, section: str | None = None) -> list[str]:
    """The ```<language> blocks of ``text``, those under the ``## <section>`` heading only when given."""
    if section is not None:
        start = text.index(f"\n## {section}\n")
        end = text.find("\n## ", start + 1)
        text = text[start:end if end != -1 else len(text)]
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def test_readme_blocks_are_found():
    """The extraction the slow test relies on: the README's two Python blocks (the second continues
    the first: "model, tokenizer, document: as above"), its command-line and lm-eval lines."""
    text = README.read_text(encoding="utf-8")
    python = readme_blocks(text, "python")
    assert len(python) == 2 and "as above" in python[1]
    cli = readme_blocks(text, "bash", "Command line")
    assert len(cli) == 1 and "jacap compress" in cli[0] and "> letter.txt" in cli[0]
    [lm_eval] = readme_blocks(text, "bash", "lm-evaluation-harness")
    assert lm_eval.startswith("lm_eval ") and "--include_path" not in lm_eval


@pytest.mark.slow  # a wheel into a fresh venv, then the README's lines on the embedded model: 5-10 min on 2 shared cores
def test_readme_lines_run_as_written_after_pip_install_from_an_empty_folder(tmp_path):
    """A new user's trial: the working tree (as a clone has it) built into a wheel, installed into a
    fresh venv with the ``eval`` extra's packages (taken from this test's venv, so torch is not
    reinstalled: a ``.pth`` line points at its site-packages, whose own start-up hooks, the checkout's
    editable install among them, do not run), then, from an empty folder outside the checkout and with
    that venv's ``python``, ``jacap`` and ``lm_eval`` first on ``PATH``: the README's Python blocks (as
    one session), its command-line block and its lm-eval line, as written. Each exits 0, jacap_attn
    comes from the venv, and every file they write lands in that folder."""
    import sysconfig

    from conftest import child_env, copy_working_tree

    assert not tmp_path.resolve().is_relative_to(ROOT)
    tree, dist, venv, work = (tmp_path / name for name in ("tree", "dist", "venv", "work"))
    copy_working_tree(ROOT, tree)
    env = child_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                    PIP_DISABLE_PIP_VERSION_CHECK="1")
    for name in ("JACAP_HOME", "XDG_CACHE_HOME"):  # the models as converted under the default home
        env.pop(name, None)

    def run(command, timeout=600, **kwargs):
        proc = subprocess.run([str(c) for c in command], env=env, capture_output=True, text=True, timeout=timeout,
                              **kwargs)
        assert proc.returncode == 0, f"{command} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        return proc

    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "--wheel-dir", dist, tree])
    [wheel] = dist.glob("jacap_attn-*.whl")
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    # The wheel, and lm-eval for its console script; then the other packages through a .pth line.
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--quiet", wheel, "lm-eval==0.4.13"])
    (pathlib.Path(site) / "zz_test_venv_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    work.mkdir()

    text = README.read_text(encoding="utf-8")
    script = work.parent / "readme_python.py"
    script.write_text("import os, sys, jacap_attn\n"
                      f"assert jacap_attn.__file__.startswith({site!r}), jacap_attn.__file__\n"
                      + "\n".join(readme_blocks(text, "python")))
    python_run = run([python, script], cwd=work, timeout=1800)
    assert any(re.search(r"[A-Za-z]{3}", line) for line in python_run.stdout.splitlines()), python_run.stdout

    shell = work.parent / "readme_lines.sh"
    shell.write_text("set -euo pipefail\n" + readme_blocks(text, "bash", "Command line")[0]
                     + readme_blocks(text, "bash", "lm-evaluation-harness")[0])
    lines = run(["bash", shell], cwd=work, timeout=3600)
    out = lines.stdout
    assert "Q: Who wrote it?" in out and "Q: In which city was it written?" in out and out.count("\nA: ") >= 2
    assert "letter.safetensors:" in out and "route" in out  # jacap inspect
    assert re.search(r"\|jacap_single_needle\|.*\|score\s*\|", out), out[-3000:]
    assert sorted(p.name for p in work.iterdir() if not p.name.startswith(".")) == \
        ["doc.safetensors", "letter.safetensors", "letter.txt"]


def _table_options(text: str) -> set[str]:
    """The option names (in backticks) of the first column of every Markdown table row of ``text``."""
    names = set()
    for cell in re.findall(r"^\| ([^|]+) \|", text, re.M):
        names |= set(re.findall(r"`([a-z_]+)`", cell))
    return names


def test_usage_tables_name_every_option():
    """docs/usage.md's option tables name every field of ``JacapConfig`` (``ratio`` and ``method``
    have their own paragraph) and of Jacap (``lookup_free`` was missing until 2026-12-07)."""
    import dataclasses

    import jacap_attn
    from jacap_attn.methods import Jacap

    named = _table_options((ROOT / "docs" / "usage.md").read_text(encoding="utf-8"))
    fields = [f.name for f in dataclasses.fields(jacap_attn.JacapConfig) + dataclasses.fields(Jacap)]
    assert [name for name in fields if name not in named and name not in ("ratio", "method")] == []
    assert "lookup_free" not in _table_options("| `lookup` | 4 |\n| lookup_free | 24 |")  # backticked names only
