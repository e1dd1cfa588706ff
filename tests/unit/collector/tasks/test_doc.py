"""docs/tasks.md's generated section (collector/tasks/doc.py) matches the code."""

from __future__ import annotations

import re

from sandpiper.collector.rewards.reference import REFERENCE_KEYS, REWARD_KINDS
from sandpiper.collector.tasks import doc
from sandpiper.collector.tasks.loading import TASK_TOML_KEYS
from tests.conftest import REPO


def test_the_page_holds_what_the_code_generates():
    page = (REPO / "docs" / "tasks.md").read_text()
    assert doc.BEGIN in page and doc.END in page
    assert doc.updated(page) == page, "stale: run `sandpiper tasks docs --write`"


def test_every_kind_is_described():
    assert set(doc.KIND_DOCS) == set(REWARD_KINDS)


def test_the_grader_sets_exactly_the_documented_variables():
    source = (REPO / "collector" / "sandbox" / "supervisor" / "grader.py").read_text()
    block = source[source.index("    env = {") : source.index("    }", source.index("    env = {"))]
    assert set(re.findall(r'"([A-Z_]+)":', block)) == set(doc.TEST_ENV)


def test_the_loader_reads_only_documented_task_toml_keys():
    source = (REPO / "collector" / "tasks" / "loading.py").read_text()
    read = set(re.findall(r'meta(?:\.get\(|\[)"([a-z_]+)"', source))
    read |= {"split"}  # with_row_split(task, meta, ...)
    assert read <= set(TASK_TOML_KEYS) | set(REFERENCE_KEYS)
