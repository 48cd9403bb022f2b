"""Every notebook under notebooks/ runs top to bottom, as a user would run it, with a tiny budget.

Adding a notebook means dropping the .ipynb into notebooks/: the tests below are parametrized over
notebooks/*.ipynb. What a notebook has to follow for them:

- stored with the outputs of a run at the full budget (`python tests/test_notebooks.py [NOTEBOOK ...]`
  executes them in place, in notebooks/);
- exactly one code cell tagged `budget` (cell metadata "tags"), the only one that reads
  NOTEBOOK_SMOKE_TEST and shrinks the budget when it is set;
- the first code cell installs what is missing and prints "nothing to install" when nothing is
  (the test makes sure it installs nothing: CI has every requirement already);
- at least one plot (an image/png output); a cell tagged `rendered-episode` must show an animation
  (walkthrough.ipynb has to have one).

Each notebook is executed by nbclient in a kernel of the interpreter running pytest, with
NOTEBOOK_SMOKE_TEST=1, in an empty folder outside the checkout with REPO_URL set to the repository's
path (so its clone is exercised); and one of them (CHECKOUT_RUN) with its working directory in notebooks/
too, so the search for the repository root is: every notebook opens with the same setup cell (tested),
and CI's clone is its committed HEAD, so a second run of each would repeat the first (CI's budget).
A failure reports the failing cell's source and its error.
"""

import base64
import io
import json
import pathlib
import re
import sys
import time

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

from conftest import ROOT

NOTEBOOKS_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT = 300  # seconds per cell; the smoke-test budget needs a few
NOTEBOOK_TIMEOUT = 600  # pytest-timeout per notebook (kernel start and every cell)
SMOKE_VAR = "NOTEBOOK_SMOKE_TEST"
CHECKOUT_RUN = "custom_env.ipynb"  # the one notebook also run in the checkout: the shortest
MUST_RENDER_EPISODE = {"walkthrough.ipynb"}  # notebooks that must have a `rendered-episode` cell
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

notebook_params = pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])


def read(path: pathlib.Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def tags(cell) -> list:
    return cell.get("metadata", {}).get("tags", [])


def test_there_are_notebooks():
    assert {"walkthrough.ipynb", CHECKOUT_RUN} <= {p.name for p in NOTEBOOKS}


def test_every_notebook_opens_with_the_same_setup_cell():
    """The setup cell (install what is missing, find or clone the repository) is the same text in every
    notebook, so the one notebook run in the checkout tests each one's search for the repository root."""
    first = {path.name: next(c.source for c in read(path).cells if c.cell_type == "code") for path in NOTEBOOKS}
    assert len(set(first.values())) == 1, f"setup cells differ: {sorted(first)}"


@notebook_params
def test_stored_with_the_outputs_of_a_full_run_and_one_budget_cell(path):
    """Committed with the outputs of a run at the full budget (`python tests/test_notebooks.py` writes
    them), so the notebook reads on a repository page: every code cell ran, in order, without an error,
    and there is a plot. The smoke test below re-executes it on every test run."""
    nb = read(path)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: run it top to bottom, once: {counts}"
    errors = [i for i, cell in enumerate(code) if any(o.output_type == "error" for o in cell.outputs)]
    assert not errors, f"{path.name}: code cells {errors} stored an error"
    assert any("image/png" in mimetypes(cell) for cell in code), f"{path.name}: no plot stored"

    budget = [cell for cell in code if "budget" in tags(cell)]
    assert len(budget) == 1, f"{path.name}: expected exactly one code cell tagged 'budget', found {len(budget)}"
    assert stdout(budget[0]).startswith("full budget"), f"{path.name}: stored from a smoke-test run"
    readers = [cell for cell in code if SMOKE_VAR in cell.source]
    assert readers == budget, f"{path.name}: only the budget cell may read {SMOKE_VAR}"

    assert "pip" in code[0].source and "nothing to install" in code[0].source, (
        f"{path.name}: the first code cell must be the install cell"
    )
    badge = f"https://colab.research.google.com/github/OWNER/REPO/blob/main/notebooks/{path.name}"
    assert any(badge in cell.source for cell in nb.cells if cell.cell_type == "markdown"), (
        f"{path.name}: no 'Open in Colab' badge pointing at {badge}"
    )


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A `python3` kernelspec for this very interpreter, found first through JUPYTER_PATH."""
    from ipykernel.kernelspec import write_kernel_spec

    jupyter_dir = tmp_path_factory.mktemp("jupyter")
    write_kernel_spec(jupyter_dir / "kernels" / "python3")
    spec = json.loads((jupyter_dir / "kernels" / "python3" / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable
    return {"JUPYTER_PATH": str(jupyter_dir)}


def failure_report(nb, error: BaseException) -> str:
    """The failing cell's index, source and error (with traceback)."""
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                trace = ANSI.sub("", "\n".join(output.get("traceback", [])))
                return (
                    f"cell {index} raised {output.ename}: {output.evalue}\n"
                    f"----- cell {index} source -----\n{cell.source}\n----- traceback -----\n{trace}"
                )
    # a timeout or a dead kernel: the cell that started and never replied
    for index, cell in enumerate(nb.cells):
        timing = cell.get("metadata", {}).get("execution", {})
        if "iopub.status.busy" in timing and "shell.execute_reply" not in timing:
            return f"cell {index} did not finish: {error}\n----- cell {index} source -----\n{cell.source}"
    return ANSI.sub("", str(error))


def mimetypes(cell) -> set:
    return {mime for output in cell.get("outputs", []) for mime in output.get("data", {})}


def stdout(cell) -> str:
    return "".join(o.text for o in cell.get("outputs", []) if o.output_type == "stream" and o.name == "stdout")


def assert_animation(cell, where: str) -> None:
    gifs = [o.data["image/gif"] for o in cell.get("outputs", []) if "image/gif" in o.get("data", {})]
    html = [o.data["text/html"] for o in cell.get("outputs", []) if "text/html" in o.get("data", {})]
    if gifs:
        from PIL import Image

        data = base64.b64decode(gifs[0])
        assert data[:4] == b"GIF8", f"{where}: image/gif output is not a GIF"
        frames = Image.open(io.BytesIO(data)).n_frames
        assert frames >= 2, f"{where}: the GIF has {frames} frame(s); expected an animation"
    else:
        assert any("<img" in h or "animation" in h.lower() for h in html), (
            f"{where}: expected an animation (image/gif or HTML), got {sorted(mimetypes(cell))}"
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "path, where",
    [(path, "outside") for path in NOTEBOOKS] + [(NOTEBOOKS_DIR / CHECKOUT_RUN, "checkout")],
    ids=[f"outside-{path.name}" for path in NOTEBOOKS] + [f"checkout-{CHECKOUT_RUN}"],
)
@pytest.mark.timeout(NOTEBOOK_TIMEOUT)
def test_notebook_runs_in_smoke_test_mode(path, where, kernel_env, monkeypatch, tmp_path):
    """`checkout`: the kernel's working directory is notebooks/, as in Jupyter opened in a clone.
    `outside`: an empty folder elsewhere, as in Colab, with the environment's REPO_URL set to this
    repository's path: the notebook clones it (its committed HEAD) and imports the files from there."""
    for name, value in kernel_env.items():
        monkeypatch.setenv(name, value)
    if where == "outside":
        monkeypatch.setenv("REPO_URL", str(ROOT))
    monkeypatch.setenv(SMOKE_VAR, "1")
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # should the install cell try pip after all: no network
    monkeypatch.delenv("MPLBACKEND", raising=False)  # Agg here would hide the kernel's inline plots

    nb = read(path)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        allow_errors=False,
        record_timing=True,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR if where == "checkout" else tmp_path)}},
    )
    start, failure = time.perf_counter(), None
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as error:
        failure = f"{path.name}: {failure_report(nb, error)}"
    if failure:  # failed outside the except block: no chained nbclient traceback in the report
        pytest.fail(failure, pytrace=False)
    seconds = time.perf_counter() - start
    print(f"{path.name}: executed in {seconds:.1f} s ({where})")
    if where == "outside":  # it ran from its own clone, not from this checkout
        assert (tmp_path / ROOT.name / "algorithms" / "ppo.py").is_file(), sorted(tmp_path.iterdir())

    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert "nothing to install" in stdout(code[0]), (
        f"{path.name}: the install cell wanted to install something:\n{stdout(code[0])}"
    )
    assert any("image/png" in mimetypes(cell) for cell in code), f"{path.name}: no plot (image/png output)"

    episodes = [(i, cell) for i, cell in enumerate(nb.cells) if "rendered-episode" in tags(cell)]
    if path.name in MUST_RENDER_EPISODE:
        assert episodes, f"{path.name}: no cell tagged 'rendered-episode'"
    for index, cell in episodes:
        assert_animation(cell, f"{path.name} cell {index}")


if __name__ == "__main__":  # python tests/test_notebooks.py [NOTEBOOK ...]: run at the full budget, outputs saved
    for path in [pathlib.Path(p).resolve() for p in sys.argv[1:]] or NOTEBOOKS:
        nb = read(path)
        start = time.perf_counter()
        NotebookClient(
            nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS_DIR)}}
        ).execute()
        for cell in nb.cells:  # the kernel's own warnings are not the notebook's output
            if cell.cell_type == "code":
                cell.outputs = [o for o in cell.outputs if not (o.output_type == "stream" and "IPKernelApp" in o.text)]
            cell.get("metadata", {}).pop("execution", None)
        nbformat.write(nb, path)
        print(f"{path.name}: executed at the full budget in {time.perf_counter() - start:.0f} s, outputs saved")
