"""examples/notebook.ipynb, executed cell by cell in a real Jupyter kernel (nbclient).

The kernel runs in examples/ (as Jupyter runs a notebook) and attaches to the test's
local Ray through RAY_ADDRESS, as a notebook on a cluster would; the parameters cell
is rewritten, papermill-style, to keep the run short.
"""

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "examples" / "notebook.ipynb"
STEPS = 6


def parameters_cell(nb):
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, "the notebook needs exactly one cell tagged 'parameters'"
    return cells[0]


def test_notebook_is_valid_nbformat_v4_with_a_parameters_cell():
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4 and nb.metadata.kernelspec.name == "python3"
    assert 'CONFIG = "../configs/tiny_cpu.yaml"' in parameters_cell(nb).source  # from examples/
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # stored clean


@pytest.mark.slow
def test_notebook_trains_on_the_attached_ray_and_plots_the_loss(ray_local, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = parameters_cell(nb)
    params.source = "\n".join(
        [  # the notebook's CONFIG stays; the run is shorter, elsewhere
            *[line for line in params.source.splitlines() if line.startswith("CONFIG =")],
            'RUN_NAME = "nb"',
            f'OUTPUT_DIR = "{tmp_path}"',
            f'OVERRIDES = ["run.max_steps={STEPS}", "run.log_every=3", "run.tensorboard=false"]',
        ]
    )
    nb.cells.append(
        nbformat.v4.new_code_cell(  # the test's probe of the kernel's state
            "import json\nprint(json.dumps({'points': len(loss_line.get_xdata()), "
            "'address': ray_address_used}))"
        )
    )
    connect = next(c for c in nb.cells if "ray.init(address=" in c.source)
    connect.source += "\nray_address_used = ray.get_runtime_context().gcs_address"
    monkeypatch.setenv("RAY_ADDRESS", ray_local.get_runtime_context().gcs_address)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    NotebookClient(
        nb,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    ).execute()  # as Jupyter

    summary = json.loads((tmp_path / "nb" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps_completed"] == STEPS
    probe = json.loads(nb.cells[-1].outputs[0]["text"])
    assert probe == {"points": STEPS, "address": os.environ["RAY_ADDRESS"]}
    fit_output = "".join(o.get("text", "") for o in nb.cells[4].outputs)
    assert (
        f"finished: {STEPS} steps, loss {summary['first_loss']:.3f} -> "
        f"{summary['final_loss']:.3f}" in fit_output
    )
    png = (tmp_path / "nb" / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (600, 350)
