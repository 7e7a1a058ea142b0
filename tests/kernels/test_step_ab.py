"""trnd.bench.step_ab: an earlier revision's kernels built beside ours (the build itself is `make venv`'s)."""

import pytest

from trnd.bench import step_ab


def test_a_revision_without_the_kernels_is_named(tmp_path):
    with pytest.raises(SystemExit, match="--rev 'no-such-rev-0': no kernels/cpu/csrc there"):
        step_ab.build_rev("no-such-rev-0", "trnd_avx2", tmp_path)


def test_cli_names_a_missing_rev(capsys):
    with pytest.raises(SystemExit):
        step_ab.main(["--batch", "1"])
    assert "the following arguments are required: --rev" in capsys.readouterr().err
