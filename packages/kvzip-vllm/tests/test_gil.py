"""Python's switch interval while the tier's threads work (``kvzip_vllm.core.gil``)."""

import sys
import threading

import pytest

from kvzip_vllm.core import gil


@pytest.fixture
def interval():
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(saved)


def test_busy_shortens_the_interval_and_gives_it_back(interval):
    with gil.busy(0.0002):
        assert sys.getswitchinterval() == pytest.approx(0.0002)
        with gil.busy(0.0002):  # nested: one change
            assert sys.getswitchinterval() == pytest.approx(0.0002)
        assert sys.getswitchinterval() == pytest.approx(0.0002)  # the outer still busy
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_busy_leaves_the_interval_when_off_or_already_shorter(interval):
    for off in (None, 0, 0.0):
        with gil.busy(off):
            assert sys.getswitchinterval() == pytest.approx(0.005)
    sys.setswitchinterval(0.0001)
    with gil.busy(0.0002):  # the process's own is shorter: kept
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    assert sys.getswitchinterval() == pytest.approx(0.0001)


def test_busy_across_threads_is_undone_by_the_last_to_leave(interval):
    entered, leave = threading.Barrier(3), threading.Event()

    def work():
        with gil.busy(0.0002):
            entered.wait(5)
            assert leave.wait(5)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    entered.wait(5)
    assert sys.getswitchinterval() == pytest.approx(0.0002)
    leave.set()
    for t in threads:
        t.join(5)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_busy_gives_the_interval_back_when_its_work_raises(interval):
    with pytest.raises(RuntimeError), gil.busy(0.0002):
        raise RuntimeError("a load that raised")
    assert sys.getswitchinterval() == pytest.approx(0.005)
