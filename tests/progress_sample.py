"""Two trivial tests that tests/test_progress.py runs in a child pytest to see the progress lines (not named test_*.py: the suite does not collect them itself)."""


def test_sample_one():
    assert 1 + 1 == 2


def test_sample_two():
    assert "a" * 2 == "aa"
