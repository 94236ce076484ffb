"""The start of a run split into phases (``metrics.start_phases``), and what a rank's start
no longer imports."""

import numpy as np
import pyarrow as pa
import pytest

from raytrain_ext.data.arrow_numpy import int_values
from raytrain_ext.metrics.start_phases import START_PHASES, start_phases
from tests.helpers.imports import modules_imported_by


def test_phases_run_from_fit_to_the_first_step_and_add_up():
    marks = {mark: 10.0 + i * 0.5 for i, (_, mark) in enumerate(START_PHASES)}
    phases = start_phases(9.0, marks)
    assert list(phases) == [name for name, _ in START_PHASES]
    assert phases["preflight"] == pytest.approx(1.0)
    assert all(phases[name] == pytest.approx(0.5) for name, _ in START_PHASES[1:])
    assert sum(phases.values()) == pytest.approx(marks["first_step_at"] - 9.0, abs=1e-9)


def test_a_missing_or_earlier_moment_counts_as_the_one_before():
    """A group formed in place has no placement; a stocked process started before its
    gang was placed; a worker's clock may run behind the driver's.  The phases still add
    up to the time to the first step, none negative."""
    marks = {
        "ray_connecting_at": 1.0,
        "ray_connected_at": 4.0,
        "process_started_at": 2.0,  # before Ray was even connected: another clock
        "init_started_at": 5.0,
        "imports_done_at": 7.0,
        "first_step_at": 9.0,
    }
    phases = start_phases(0.5, marks)
    assert phases["placement"] == 0.0 and phases["worker_process"] == 0.0
    assert phases["worker_init"] == pytest.approx(1.0)
    assert phases["rendezvous"] == 0.0 and phases["build"] == 0.0
    assert phases["first_step"] == pytest.approx(2.0)
    assert min(phases.values()) >= 0.0
    assert sum(phases.values()) == pytest.approx(8.5)


@pytest.mark.parametrize("kind", [pa.uint8(), pa.int16(), pa.uint32(), pa.int64()])
def test_int_values_is_the_arrays_values_at_any_offset(kind):
    values = np.arange(50) % 200
    array = pa.array(values, type=kind)
    for view in (array, array.slice(7, 30)):
        got = int_values(view)
        assert got.dtype == kind.to_pandas_dtype()
        assert np.array_equal(got, view.to_numpy())


def test_int_values_with_nulls_takes_pyarrows_conversion():
    got = int_values(pa.array([1, None, 3], type=pa.int32()))
    assert got[0] == 1 and np.isnan(got[1]) and got[2] == 3


def test_a_ranks_token_data_does_not_import_pandas():
    """pyarrow's ``to_numpy`` imports pandas (0.1-0.3 s of every rank's start): reading the
    token column and taking batches from it must not."""
    code = (
        "from raytrain_ext.data import open_token_dataset\n"
        "data = open_token_dataset('builtin:corpus', 32)\n"
        "data.batch([0, 1])\n"
    )
    assert modules_imported_by(code, ("pandas",)) == []
