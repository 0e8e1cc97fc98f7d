"""`meshkit mesh`: tables, --rank, --json, --plot, and errors exit 2."""

import json
from pathlib import Path

import pytest

from meshkit.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_mesh_default_table(capsys):
    assert main(["mesh"]) == 0
    out = capsys.readouterr().out
    assert "Strategy(node=2, device=4)" in out
    assert "node       2  (0,4) (1,5) (2,6) (3,7)" in out
    assert "device     4  (0,1,2,3) (4,5,6,7)" in out


def test_mesh_rank(capsys):
    assert main(["mesh", str(ROOT / "configs/default.yaml"), "--rank", "5"]) == 0
    out = capsys.readouterr().out
    assert "rank 5: node=1, device=1" in out
    assert "device  (4,5,6,7)                    4     6" in out


def test_mesh_json(capsys):
    assert main(["mesh", "--rank", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["axes"] == {"node": 2, "device": 4}
    assert report["groups"]["node"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert report["rank"] == {
        "rank": 5,
        "coords": {"node": 1, "device": 1},
        "groups": {"node": [1, 5], "device": [4, 5, 6, 7]},
        "neighbors": {"node": [1, 1], "device": [4, 6]},
    }


def test_mesh_four_axes(capsys):
    assert main(["mesh", str(ROOT / "configs/dp_pp_ep_tp.yaml"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["axes"]) == ["dp", "pp", "ep", "tp"]


def test_mesh_plot(tmp_path):
    png = tmp_path / "mesh.png"
    assert main(["mesh", "--plot", str(png), "--axis", "node"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["mesh", "--rank", "8"], "rank 8 out of range 0..7"),
        (["mesh", "nope.yaml"], "config file not found: nope.yaml"),
        (["mesh", "--plot", "x.png", "--axis", "gpu"], "--axis 'gpu' is not an axis"),
    ],
)
def test_mesh_errors_exit_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from meshkit.cli import main; sys.exit(main(['mesh', '--plot', 'x.png']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2
    assert "pip install 'meshkit[plot]'" in done.stderr
