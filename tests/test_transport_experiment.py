"""`testbed run transport`: the link's cost as records (push/pull MB/s with verification, command
round trip), on the real peers."""

import pytest

from testbed import config, runner


@pytest.mark.parametrize("where", ["local_device", "adb_device", "ssh_device"])
def test_transport_records(request, where, results_dir):
    device = request.getfixturevalue(where)
    outcome = runner.execute(config.load(["experiment=transport", "size_mb=1", "reps=2"]), device=device)
    df = outcome.frame().set_index("case")
    assert list(df.index) == ["push", "pull", "run"]
    assert df.loc["push", "work.bytes"] == 1 << 20 and df.loc["push", "figures.rate.unit"] == "MB/s"
    assert df.loc["run", "figures.time.reps"] == 8 and df.loc["run", "figures.time.unit"] == "ms"
    assert device.run(["ls", "transport"]).returncode != 0  # nothing left on the device


def test_bad_sizes_are_refused():
    from testbed.errors import UsageError

    with pytest.raises(UsageError, match="size_mb=0 is out of range"):
        runner.check(config.load(["experiment=transport", "size_mb=0"]))
