"""`meshkit mesh`: tables, --rank, --json, --plot, and errors exit 2."""

import json
from pathlib import Path

import pytest

from meshkit.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_mesh_default_table(capsys):
    assert main(["mesh"]) == 0
    out = capsys.readouterr().out
    assert "Strategy(node=2, device=4)" in out
    assert "node       2  expert    (0,4) (1,5) (2,6) (3,7)" in out
    assert "device     4  expert    (0,1,2,3) (4,5,6,7)" in out


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
        "roles": {"expert": {"axes": ["node", "device"], "group": list(range(8))}},
    }


def test_mesh_four_axes(capsys):
    assert main(["mesh", str(ROOT / "configs/dp_pp_ep_tp.yaml"), "--json", "--rank", "5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["axes"]) == ["dp", "pp", "ep", "tp"]
    assert report["roles"] == {"dp": "data", "pp": "pipeline", "ep": "expert", "tp": "tensor"}
    assert report["rank"]["roles"] == {
        "data": {"axes": ["dp"], "group": [5]},
        "tensor": {"axes": ["tp"], "group": [4, 5]},
        "pipeline": {"axes": ["pp"], "group": [1, 5], "neighbors": [1, 1]},
        "expert": {"axes": ["ep"], "group": [5, 7]},
    }


def test_mesh_prints_each_roles_groups_for_a_rank(capsys):
    overrides = ["mesh.axes={pp: 2, fsdp: 2, tp: 2}", "parallel.pipeline=pp",
                 "parallel.fsdp=fsdp", "parallel.tensor=tp", "exchange.node_axis=[]",
                 "exchange.device_axis=[]"]
    assert main(["mesh", *overrides, "--rank", "6"]) == 0
    out = capsys.readouterr().out
    assert "fsdp     2  fsdp      (0,2) (1,3) (4,6) (5,7)" in out
    assert "fsdp      fsdp              (4,6)" in out
    assert "tensor    tp                (6,7)" in out
    assert "pipeline  pp                (2,6)  prev 2, next 2" in out
    assert "expert" not in out.split("role ")[-1]  # no expert axes: no expert group


def test_mesh_says_which_axes_got_no_role_and_shows_context(capsys):
    # Nothing gets a role by its name: `cp` is a data axis until parallel.context names it.
    axes = ["mesh.axes={dp: 2, cp: 4}", "exchange.node_axis=[]", "exchange.device_axis=[]"]
    assert main(["mesh", *axes, "parallel.data=dp"]) == 0
    out = capsys.readouterr().out
    assert "dp       2  data                  (0,4)" in out
    assert "cp       4  data (no role given)  (0,1,2,3) (4,5,6,7)" in out
    assert main(["mesh", *axes, "parallel.context=cp", "--rank", "5"]) == 0
    out = capsys.readouterr().out
    assert "dp       2  data (no role given)  (0,4)" in out
    assert "cp       4  context               (0,1,2,3) (4,5,6,7)" in out
    assert "context   cp                (4,5,6,7)  prev 4, next 6" in out  # the ring's
    assert main(["mesh", *axes, "parallel.context=cp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["roles"] == {"dp": "data", "cp": "context"}
    assert report["no_role_given"] == ["dp"]
    # Two context axes: one ring over both, the outer one's index first.
    two = ["mesh.axes={cpn: 2, pp: 2, cpd: 2}", "parallel.pipeline=pp",
           "parallel.context=[cpn, cpd]", "exchange.node_axis=[]", "exchange.device_axis=[]"]
    assert main(["mesh", *two, "--rank", "4"]) == 0
    assert "context   cpn+cpd           (0,1,4,5)  prev 1, next 5" in capsys.readouterr().out


def test_mesh_plot_by_role(tmp_path):
    png = tmp_path / "tp.png"
    assert main(["mesh", str(ROOT / "configs/dp_pp_ep_tp.yaml"), "--plot", str(png),
                 "--role", "tensor"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
        (["mesh", "--plot", "x.png", "--role", "tensor"],
         "--role tensor: no mesh axis has this role"),
        (["mesh", "--plot", "x.png", "--role", "expert", "--axis", "node"],
         "--axis and --role both choose the plot's colours"),
    ],
)
def test_mesh_errors_exit_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_an_unknown_role_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["mesh", "--role", "ep"])
    assert exit_.value.code == 2
    assert "argument --role: invalid choice: 'ep'" in capsys.readouterr().err


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
