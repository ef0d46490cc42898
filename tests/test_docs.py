"""The documentation keeps its shape: docs/performance.md a short reference of current figures
(each section with its command and commit), the README without commit hashes, and every link
between the Markdown files landing on a heading that exists."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PERFORMANCE = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
LINKED = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]

PERFORMANCE_MAX_BYTES = 48 * 1024
README_MAX_BYTES = 15 * 1024
README_MAX_HASHES = 3

# A commit as the docs cite it: 7 to 40 hex digits, at least one digit and one letter.
_HASH = re.compile(r"(?<![0-9A-Za-z_/.#-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
# A command: a fenced block, or inline code that starts with a launcher.
_LAUNCHERS = ("python", "sudo", "make", "bash", "horovodrun", "mpirun", "torchrun", "srun", "pip")
_INLINE_COMMAND = re.compile(r"`(?:[A-Z_]+=\S+ )*(?:%s)\b[^`]*`" % "|".join(_LAUNCHERS))
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def strip_code(text):
    """The text without its fenced blocks (headings and links there are not Markdown's)."""
    return _FENCE.sub("", text)


def commit_hashes(text):
    return _HASH.findall(text)


def names_command(text):
    return bool(_FENCE.search(text) or _INLINE_COMMAND.search(text))


def sections(text):
    """(heading, body) for each level-2 section; the body holds its subsections."""
    parts = re.split(r"^## (.+)$", strip_code_headings(text), flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def strip_code_headings(text):
    # Keep the fenced blocks (a section's command may be one) but hide '## ' lines inside them.
    return _FENCE.sub(lambda m: m.group(0).replace("\n#", "\n #"), text)


def slug(heading):
    """GitHub's anchor for a heading."""
    h = heading.strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(text):
    seen = {}
    out = set()
    for line in strip_code(text).splitlines():
        m = re.match(r"^#{1,6} (.+?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path, text=None):
    """Each relative link of a Markdown file whose file or heading does not exist."""
    text = path.read_text() if text is None else text
    bad = []
    for target in _LINK.findall(strip_code(text)):
        if re.match(r"^[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(target)
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(text if dest == path else dest.read_text()):
            bad.append(target)
    return bad


def results_rows(readme_text):
    """The rows of the README's results table."""
    body = readme_text.split("\n## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("|")]
    return rows[2:]  # past the header and its rule


def test_performance_md_is_a_short_reference():
    size = len(PERFORMANCE.read_bytes())
    assert size <= PERFORMANCE_MAX_BYTES, f"docs/performance.md is {size} bytes; history goes to CHANGELOG.md"


@pytest.mark.parametrize("heading,body", sections(PERFORMANCE.read_text()))
def test_each_performance_section_names_its_command_and_commit(heading, body):
    assert names_command(body), f"'{heading}' names no command"
    assert commit_hashes(body), f"'{heading}' names no commit"


def test_readme_carries_few_commit_hashes():
    found = commit_hashes(README.read_text())
    assert len(found) <= README_MAX_HASHES, f"README.md cites commits {found}: they belong in docs/performance.md"


def test_readme_is_a_short_guide():
    assert len(README.read_bytes()) <= README_MAX_BYTES


def test_readme_results_rows_link_to_their_figures():
    rows = results_rows(README.read_text())
    assert rows
    linked = [r for r in rows if re.search(r"\]\(docs/[\w.]+\.md#[\w-]+\)", r)]
    # A row that repeats the row above ("the same: ...") shares its link.
    unlinked = [r for r in rows if r not in linked and not r.startswith("| the same")]
    assert not unlinked, f"results rows without a link to their figures: {unlinked}"


@pytest.mark.parametrize("path", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_docs_resolve(path):
    assert not broken_links(path), f"{path.relative_to(ROOT)}: links to no file or heading: {broken_links(path)}"


def test_the_checks_see_what_they_look_for():
    assert slug("`bench torchrun`: a user's script against DDP") == "bench-torchrun-a-users-script-against-ddp"
    assert slug("The bound, the thinning of T_v, and the freeze, one at a time (P = 64)") == (
        "the-bound-the-thinning-of-t_v-and-the-freeze-one-at-a-time-p--64"
    )
    assert commit_hashes("at fc204f8 and 3532e0c, not arXiv:2202.06009 nor 1234567 nor defaced") == [
        "fc204f8",
        "3532e0c",
    ]
    assert names_command("run `python -m hvd_zoadam.bench step`") and not names_command("the `step()` call")
    text = "# A\n\n## B c\n\n[x](#b-c) [y](#missing)\n"
    assert broken_links(README, text) == ["#missing"]
