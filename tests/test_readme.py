"""Every ```python block of README.md runs as written.

The blocks run in the README's order in one namespace (a later example may use what an earlier
one made, as a reader running them one after the other would), in a temporary directory, on
the device the README picks: "cuda" if torch.cuda.is_available() else "cpu"; a process given a
later block without the earlier ones (pytest-xdist, DQN_OPS_TEST_SHARD) runs those first. A block that cannot
run here must say why in an HTML comment just before it, ``<!-- readme-test: skip REASON -->``;
it is then skipped with that reason (none is, today).
"""
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
FENCE = re.compile(r"(?:<!--\s*readme-test:\s*skip\s+(?P<skip>.*?)\s*-->\s*\n)?^```python\n(?P<code>.*?)^```",
                   re.M | re.S)


def _blocks():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        out.append((line, m.group("code"), m.group("skip")))
    return out


BLOCKS = _blocks()
_namespace = {"__name__": "__readme__"}
_failed = []
_ran = set()  # the lines of the blocks this process has run (into _namespace)


def _run_block(line, code):
    exec(compile(code, f"README.md:{line}", "exec"), _namespace)
    _ran.add(line)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 3, f"expected the README's Python examples, found {len(BLOCKS)} ```python blocks"


@pytest.mark.parametrize("line,code,skip", BLOCKS, ids=[f"README.md:{b[0]}" for b in BLOCKS])
def test_readme_block(line, code, skip, tmp_path, monkeypatch, capsys):
    if skip:
        pytest.skip(skip)
    if _failed:
        pytest.fail(f"an earlier README block failed (README.md:{_failed[0]}); this one may depend on it")
    monkeypatch.chdir(tmp_path)  # what an example writes (a checkpoint) lands here
    # The earlier blocks this process has not run (pytest-xdist or DQN_OPS_TEST_SHARD gave them
    # to another process) run first, as the reader would have run them.
    for earlier_line, earlier_code, earlier_skip in BLOCKS:
        if earlier_line >= line:
            break
        if earlier_line not in _ran and not earlier_skip:
            try:
                _run_block(earlier_line, earlier_code)
            except BaseException:
                _failed.append(earlier_line)
                raise
    try:
        _run_block(line, code)
    except BaseException:
        _failed.append(line)
        raise
